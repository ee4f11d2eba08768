"""What changes a row's logits besides the model, and the per-request state it needs: bans (min_tokens), logit
bias, penalties, grammar masks. The engine's step calls `for_batch` before sampling and `accept` for each token it
appends; everything else about sampling state lives here."""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.grammar import GrammarCompiler, RequestGrammar, apply_token_masks
from pdserve.engine.penalties import apply_logit_bias, apply_penalties
from pdserve.engine.request import Request
from pdserve.wire.sampling import SamplingParams


@dataclass
class BatchLogitsProcessing:
    """One step's processing of the sampled rows (rows in the order of the requests given to `for_batch`)."""

    requests: list[Request]
    banned_token_ids: list[list[int]]

    def apply(self, logits: torch.Tensor) -> None:
        """Bias, penalties and grammar masks, in place on float32 logits [B, V] (bans are the sampler's)."""
        apply_logit_bias(logits, [r.sampling.logit_bias for r in self.requests])
        apply_penalties(logits, [r.sampling for r in self.requests], [r.prompt_token_ids for r in self.requests],
                        [r.output_token_ids for r in self.requests])
        constrained = [row for row, r in enumerate(self.requests) if r.grammar is not None]
        apply_token_masks(logits, constrained, [self.requests[row].grammar.mask_words() for row in constrained])


class LogitsProcessing:
    def __init__(self, tokenizer_json: Path | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._grammars = GrammarCompiler(tokenizer_json, vocab_size, self._eos_token_ids)

    def check(self, sampling: SamplingParams) -> None:
        """Raises ValueError for settings this model cannot honour."""
        if bad := [t for t in sampling.logit_bias if not 0 <= t < self.vocab_size]:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def grammar_for(self, sampling: SamplingParams, prompt_token_ids: Sequence[int]) -> RequestGrammar | None:
        """A fresh matcher for the request's grammar, past its continued tokens (raises GrammarError, a ValueError,
        when it does not compile or they do not follow it)."""
        if sampling.grammar is None:
            return None
        continued = prompt_token_ids[len(prompt_token_ids) - sampling.continued_tokens:]
        return self._grammars.matcher(sampling.grammar, continued)

    @staticmethod
    def needs_sync(requests: Sequence[Request]) -> bool:
        """Rows whose processing reads their output tokens on the host: a grammar's next mask and the penalties'
        token counts need the token sampled last before the next step samples, so an overlapped engine steps such
        batches synchronously."""
        return any(r.grammar is not None or r.sampling.penalized for r in requests)

    def for_batch(self, requests: Sequence[Request]) -> BatchLogitsProcessing:
        return BatchLogitsProcessing(list(requests), [self._banned_ids(r) for r in requests])

    def _banned_ids(self, request: Request) -> list[int]:
        if request.num_output_tokens >= request.sampling.min_tokens:  # unresolved tokens count: min_tokens needs no ids
            return []
        # A grammar decides itself when the sequence may end: banning the end there could leave no token at all.
        eos = [] if request.sampling.ignore_eos or request.grammar is not None else self._eos_token_ids
        return eos + list(request.sampling.stop_token_ids)

    @staticmethod
    def accept(request: Request, token_id: int) -> bool:
        """Advance the request's state by its new token; True when its grammar is complete (the request ends)."""
        if request.grammar is None:
            return False
        request.grammar.accept(token_id)
        return request.grammar.finished
