"""Turn one request's output tokens into streamable text, and cut it at the first stop string.

Decoding works on a short window of recent tokens (prefix-offset technique): the text of the window's already
emitted part is subtracted from the text of the whole window. With byte-level BPE a character may span several
tokens; while the window's text ends in U+FFFD (an unfinished UTF-8 sequence) nothing is emitted for it.
"""

import tokenizers

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
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            # A prompt cut inside a character would glue its bytes to the output's; start clean instead.
            context = []
        self._token_ids = context
        self._prefix_offset = 0  # window start: tokens before it are never decoded again
        self._read_offset = len(context)  # tokens before it have been turned into text
        self._held = ""  # decoded text kept back because it may be the start of a stop string
        self._text = ""
        self._stopped = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been hit (no more text comes after that)."""
        return self._stopped

    def push(self, token_ids: list[int]) -> tuple[str, bool]:
        """Add output tokens; returns the new text safe to emit and whether a stop string was hit."""
        if self._stopped:
            return "", True
        self._token_ids.extend(token_ids)
        return self._release(self._new_text(final=False), final=False)

    def flush(self) -> str:
        """At finish without a stop string: release everything held back, unfinished characters included."""
        if self._stopped:
            return ""
        released, _ = self._release(self._new_text(final=True), final=True)
        return released

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _new_text(self, final: bool) -> str:
        emitted = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._token_ids[self._prefix_offset :])
        if len(window) <= len(emitted) or (window.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        # The window's text up to read_offset ended on a whole character, so it is a prefix of the longer text.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return window[len(emitted) :]

    def _release(self, new_text: str, final: bool) -> tuple[str, bool]:
        if not self._stop:  # nothing to look for or hold back (most requests)
            self._text += new_text
            return new_text, False
        # Held text is never a full stop string and emitted text never ends in the start of one, so a stop string
        # can only appear within held + new text.
        pending = self._held + new_text
        hits = [at for at in (pending.find(stop) for stop in self._stop) if at >= 0]
        if hits:
            released, self._held, self._stopped = pending[: min(hits)], "", True
        else:
            keep = 0 if final else self._stop_prefix_len(pending)
            released, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self._text += released
        return released, self._stopped

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of `text` that some stop string starts with."""
        longest = min(len(text), max((len(stop) - 1 for stop in self._stop), default=0))
        for length in range(longest, 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0
