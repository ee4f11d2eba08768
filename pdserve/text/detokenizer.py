"""Turn one request's output tokens into streamable text, and cut it at the first stop string.

Decoding is `tokenizers`' DecodeStream: it keeps a short window of recent tokens and emits the window's text past the
part already emitted (the prefix-offset technique), holding back text that ends in U+FFFD (an unfinished UTF-8
sequence of byte-level BPE). One call into Rust a token: this runs for every token of every request on a rank's step
thread, where the Python of a window decode of our own cost several times as much under the other threads' GIL turns.
"""

import tokenizers
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the output, so that decoders that depend on what precedes a token (e.g. a
# leading-space marker) render the first output tokens as they read mid-text.
PROMPT_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._context_text = self._decode(context)
        if self._context_text.endswith(REPLACEMENT_CHAR):
            # A prompt cut inside a character would glue its bytes to the output's; start clean instead.
            context, self._context_text = [], ""
        self._context = context
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._token_ids: list[int] = []  # the output so far, for the final flush
        self._streamed = 0  # characters the stream has given out
        self._pending = False  # tokens pushed since the stream last gave text
        self._held = ""  # decoded text kept back because it may be the start of a stop string
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been hit (no more text comes after that)."""
        return self._stopped

    def push(self, token_ids: list[int]) -> tuple[str, bool]:
        """Add output tokens; returns the new text safe to emit and whether a stop string was hit."""
        if self._stopped:
            return "", True
        self._token_ids.extend(token_ids)
        # One id as an int: the list form costs a third more per call.
        new_text = self._stream.step(self._tokenizer, token_ids[0] if len(token_ids) == 1 else token_ids)
        self._pending = new_text is None
        if new_text is None:
            return "", False
        self._streamed += len(new_text)
        if not self._stop:  # nothing to look for or hold back (most requests)
            return new_text, False
        return self._release(new_text, final=False)

    def flush(self) -> str:
        """At finish without a stop string: release everything held back, unfinished characters included (the text
        a decode of the whole output ends with)."""
        if self._stopped:
            return ""
        rest = ""
        if self._pending:  # rare: the last tokens ended inside a character, or added nothing
            whole = self._decode(self._context + self._token_ids)
            rest = whole[len(self._context_text) + self._streamed :]
        released, _ = self._release(rest, final=True)
        return released

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _release(self, new_text: str, final: bool) -> tuple[str, bool]:
        # Held text is never a full stop string and emitted text never ends in the start of one, so a stop string
        # can only appear within held + new text.
        pending = self._held + new_text
        hits = [at for at in (pending.find(stop) for stop in self._stop) if at >= 0]
        if hits:
            released, self._held, self._stopped = pending[: min(hits)], "", True
        else:
            keep = 0 if final else self._stop_prefix_len(pending)
            released, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        return released, self._stopped

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of `text` that some stop string starts with."""
        longest = min(len(text), max((len(stop) - 1 for stop in self._stop), default=0))
        for length in range(longest, 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0
