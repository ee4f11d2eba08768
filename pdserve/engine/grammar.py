"""Grammar-constrained decoding with llguidance: one matcher per constrained request, advanced by each accepted
token; the next step's token mask is computed on a small thread right after the token is accepted, so it overlaps
the next forward pass (llguidance drops the GIL while it computes) and sampling only waits for what is left.

A constrained row's mask depends on the token the row just sampled, known on the host only once the step has
synchronized; so a batch with any constrained row must step synchronously (`LogitsProcessing.needs_sync`).

Why llguidance (not xgrammar or outlines-core): no per-schema precompilation over the vocabulary (a new schema
starts at once; each mask is computed lazily by an Earley parser over a token trie), no torch or CUDA dependency (the
router validates grammars with it too),
Lark grammars that reference special tokens by id (tool-call markers) and embed JSON Schemas (`%json`)."""

import concurrent.futures
import logging
from collections.abc import Sequence
from pathlib import Path

import llguidance
import numpy as np
import torch
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from pdserve.text.grammars import GrammarError, llguidance_grammar
from pdserve.wire.sampling import Grammar

log = logging.getLogger(__name__)


class GrammarCompiler:
    """Builds matchers for one model's vocabulary. The llguidance tokenizer (about a second for a 129k vocabulary)
    is made on the first constrained request, so engines that never see one never pay for it."""

    def __init__(self, tokenizer_json: Path | None, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._mask_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def matcher(self, grammar: Grammar, accepted_token_ids: Sequence[int] = ()) -> "RequestGrammar":
        """`accepted_token_ids`: output already generated under the grammar elsewhere (a migrated stream), which
        the matcher is advanced by before the first step."""
        if self._tokenizer_json is None:
            raise GrammarError("constrained decoding needs a tokenizer.json in the model directory")
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(str(self._tokenizer_json), n_vocab=self.vocab_size,
                                                     eos_token=self._eos_token_ids)
        matcher = llguidance.LLMatcher(self._tokenizer, llguidance_grammar(grammar.kind, grammar.source), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {grammar.kind} grammar: {matcher.get_error()}")
        if accepted_token_ids and not matcher.consume_tokens(list(accepted_token_ids)):
            raise GrammarError(f"the tokens already generated do not follow the grammar: {matcher.get_error()}")
        return RequestGrammar(matcher, self.vocab_size, self._mask_thread)


class RequestGrammar:
    """One request's matcher and its next-token mask (computed ahead on the mask thread)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int,
                 mask_thread: concurrent.futures.ThreadPoolExecutor) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._mask_thread = mask_thread
        self._mask = allocate_token_bitmask(1, vocab_size)
        self._pending: concurrent.futures.Future | None = None
        # Read on the step thread while the mask thread may hold the matcher (llguidance refuses a second borrow):
        # so it is taken whenever the matcher changes, before the mask thread gets it.
        self._stopped = matcher.is_stopped()
        self._compute_next_mask()

    @property
    def finished(self) -> bool:
        """The grammar is complete (or broken): nothing but end of sequence may follow."""
        return self._stopped

    def mask_words(self) -> np.ndarray:
        """The allowed next tokens as int32 bit words [ceil(V / 32)], bit i of word w = token 32 w + i."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        return self._mask[0]

    def accept(self, token_id: int) -> None:
        if self._pending is not None:  # never consume while the thread still reads the matcher
            self._pending.result()
            self._pending = None
        accepted = self._matcher.consume_token(token_id)
        self._stopped = self._matcher.is_stopped()
        if not accepted:
            log.warning("grammar rejected token %s: %s", token_id, self._matcher.get_error())
        elif not self._stopped:
            self._compute_next_mask()

    def _compute_next_mask(self) -> None:
        self._pending = self._mask_thread.submit(fill_next_token_bitmask, self._matcher, self._mask)


def apply_token_masks(logits: torch.Tensor, rows: list[int], masks: list[np.ndarray]) -> None:
    """Set to -inf, in rows `rows` of `logits` [B, V], every token its mask does not allow."""
    if not rows:
        return
    device, vocab_size = logits.device, logits.shape[1]
    words = torch.from_numpy(np.stack(masks)).to(device)  # [R, W] int32
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab_size]
    index = torch.tensor(rows, device=device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
