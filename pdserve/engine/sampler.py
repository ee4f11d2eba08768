"""Pick the next token of every sequence in a batch from its last-position logits, each row by its own settings.

Filtering (temperature, top-k, top-p, min-p) is vectorized over the batch; the random draw of each row uses only
that row's generator, so a seeded request gets the same tokens whatever else shares its batch.

Log-probabilities are the model's own (log-softmax of the logits as the model produced them), before bans, bias,
penalties, grammar masks and temperature, as vLLM reports them by default.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.device_values import on_device
from pdserve.wire.sampling import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # model log-probability of each chosen token; None when no row asked
    # per row: its top_logprobs most likely tokens and their log-probabilities, best first; None when no row asked
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclass
class DeviceSample:
    """A sample still where it was drawn: the tensors of a SampleResult (an overlapped step keeps its token ids on the
    device as the next step's input and copies the rest to the host asynchronously)."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32
    top_token_ids: torch.Tensor | None  # [B, most top_logprobs asked] int64
    top_logprobs: torch.Tensor | None  # [B, most top_logprobs asked] float32

    def to_host(self, non_blocking: bool = False) -> "DeviceSample":
        """CPU copies (into pinned memory when `non_blocking`: the copy is done once the stream reaches it)."""
        def copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None or tensor.device.type == "cpu":
                return tensor
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=non_blocking)
            return host.copy_(tensor, non_blocking=non_blocking)

        return DeviceSample(copy(self.token_ids), copy(self.logprobs), copy(self.top_token_ids),
                            copy(self.top_logprobs))

    def result(self, params: Sequence[SamplingParams]) -> SampleResult:
        """As lists (waits for the device when the tensors are still there), each row cut to what it asked for."""
        result = SampleResult(token_ids=self.token_ids.tolist(), logprobs=None)
        if self.logprobs is not None:
            result.logprobs = self.logprobs.tolist()
        if self.top_token_ids is not None and self.top_logprobs is not None:
            ids, values = self.top_token_ids.tolist(), self.top_logprobs.tolist()
            result.top_token_ids = [row[: p.top_logprobs] for row, p in zip(ids, params)]
            result.top_logprobs = [row[: p.top_logprobs] for row, p in zip(values, params)]
        return result


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    banned_token_ids: Sequence[Sequence[int]],
    adjust: Callable[[torch.Tensor], None] | None = None,
) -> SampleResult:
    """Next token per row of `logits` [B, V]; `generators` live on `logits.device`, one per row (may be shared);
    `adjust` changes the float32 logits in place after the bans (bias, penalties, grammar masks)."""
    return sample_on_device(logits, params, generators, banned_token_ids, adjust).result(params)


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    banned_token_ids: Sequence[Sequence[int]],
    adjust: Callable[[torch.Tensor], None] | None = None,
) -> DeviceSample:
    """`sample` without waiting for the device: the result's tensors are on `logits.device`."""
    batch_size = logits.shape[0]
    if logits.dim() != 2 or not (len(params) == len(generators) == len(banned_token_ids) == batch_size):
        raise ValueError(
            f"expected logits [B, V] and B params/generators/banned lists, got logits {tuple(logits.shape)}, "
            f"{len(params)} params, {len(generators)} generators, {len(banned_token_ids)} banned lists"
        )
    # Copy: the caller's logits stay untouched whatever their dtype.
    logits = logits.to(torch.float32, copy=True)
    model_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs or p.top_logprobs for p in params) else None
    _ban(logits, banned_token_ids)
    if adjust is not None:
        adjust(logits)

    # argmax returns the first maximal index, so greedy ties go to the lowest token id.
    token_ids = logits.argmax(dim=-1)
    random_rows = [row for row, row_params in enumerate(params) if not row_params.greedy]
    if random_rows:
        rows = on_device(random_rows, logits.device)
        probs = filtered_probs(logits[rows], [params[row] for row in random_rows])
        token_ids[rows] = _draw(probs, [generators[row] for row in random_rows])

    result = DeviceSample(token_ids, None, None, None)
    if model_logprobs is not None:
        result.logprobs = model_logprobs.gather(1, token_ids[:, None]).squeeze(1)
        most = max(p.top_logprobs for p in params)
        if most:
            result.top_logprobs, result.top_token_ids = model_logprobs.topk(most, dim=-1)
    return result


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities [B, V] after temperature, top-k, top-p and min-p, each row by its own params (all non-greedy)."""
    vocab_size = logits.shape[1]
    device = logits.device
    temperatures = on_device([p.temperature for p in params], device, torch.float32)
    logits = logits / temperatures[:, None]

    uses_top_k = any(p.top_k != -1 for p in params)
    uses_top_p = any(p.top_p < 1.0 for p in params)
    if uses_top_k or uses_top_p:
        # Stable descending sort keeps the lower id first among equal logits, so cut-offs on ties are deterministic.
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        if uses_top_k:
            top_k = on_device([p.top_k if p.top_k != -1 else vocab_size for p in params], device)
            rank = torch.arange(vocab_size, device=device)
            sorted_logits.masked_fill_(rank[None, :] >= top_k[:, None], float("-inf"))
        if uses_top_p:
            top_p = on_device([p.top_p for p in params], device, torch.float32)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            # Keep a token while the mass of the tokens ranked above it is still short of top_p: the smallest set
            # reaching top_p, never empty (the top token has mass 0 above it and top_p > 0). Rows at top_p == 1 are
            # exempt so rounding in cumsum cannot trim them.
            drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
            sorted_logits.masked_fill_(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)

    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        # Relative to the row's top probability, which top-k/top-p always keep, so the order of filters is moot here.
        min_p = on_device([p.min_p for p in params], device, torch.float32)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _ban(logits: torch.Tensor, banned_token_ids: Sequence[Sequence[int]]) -> None:
    rows = [row for row, banned in enumerate(banned_token_ids) for _ in banned]
    if rows:
        cols = [token_id for banned in banned_token_ids for token_id in banned]
        logits[on_device(rows, logits.device), on_device(cols, logits.device)] = float("-inf")


def skip_draws(generator: torch.Generator, vocab_size: int, count: int) -> None:
    """Advance `generator` as `count` row draws over `vocab_size` tokens do: a request whose tokens were drawn
    elsewhere from the same seed (its prefill rank, a worker that died mid-stream) then draws the tokens that follow
    as one rank drawing them all would. On CUDA one draw measures how far a draw moves Philox's offset, and the rest
    is one jump: a stream migrated after thousands of tokens costs its new rank no kernel per token."""
    def draw() -> None:
        torch.empty(vocab_size, dtype=torch.float32, device=generator.device).exponential_(generator=generator)

    if generator.device.type != "cuda":
        for _ in range(count):
            draw()
    elif count > 0:
        start = generator.get_offset()
        draw()
        generator.set_offset(start + count * (generator.get_offset() - start))


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row, drawn from `probs` [B, V] by an exponential race: argmax(p / E) with E ~ Exp(1) i.i.d.

    picks token i with probability p_i. Only the noise comes from each row's generator, one row at a time; the
    argmax over the batch is a single vectorized op.
    """
    noise = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    # An exact 0 from the sampler would turn a filtered token's 0 / 0 into NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)
