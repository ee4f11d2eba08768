"""The worker's internal API (version 1): typed messages encoded with msgspec (JSON over HTTP, msgpack over the
channel), never pickled.

Generate streams run over the worker channel (pdserve/wire/channel.py): a long-lived TCP connection on the port
`WorkerInfo.channel_port` names, authenticated by a first Hello frame carrying the internal credential, then many
concurrent streams multiplexed by id: Generate(GenerateRequest) -> Events(TokenEvents)... until a finish_reason, or a
Refusal with an HTTP status; Cancel stops one.

Endpoints (on the worker's HTTP port; see docs/architecture.md):
  GET  /health                            -> WorkerHealth
  GET  /internal/v1/info                  -> WorkerInfo
  GET  /internal/v1/load                  -> LoadReport
  POST /internal/v1/generate              GenerateRequest -> NDJSON stream of TokenEvent (the channel's generate, for
                                          operators with curl; callers use the channel)
  POST /internal/v1/abort                 AbortRequest -> {}
  GET  /internal/v1/kv_events?rank=R&after=SEQ -> NDJSON stream of KVEventBatch (long-lived)
  POST /internal/v1/transfer/reservation  ReservationQuery -> Reservation (decode worker; 403 unless the token fits)
  GET  /metrics                           -> Prometheus text
"""

from dataclasses import dataclass, field
from typing import Literal

from pdserve.wire.kv_events import KVEvent
from pdserve.wire.sampling import SamplingParams

API_VERSION = 1

Role = Literal["prefill", "decode", "both"]
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class PrefillSource:
    """Where a decode-after-transfer request gets its KV: a prefill worker and one of its ranks."""

    url: str
    rank: int


@dataclass
class KVDestination:
    """Where a prefill-only request writes its KV: a reservation a decode rank made. The prefill worker trusts none
    of it as given: it resolves `url` among the workers it discovered and asks that worker, with the token, for the
    reservation itself (`Reservation`)."""

    url: str  # the decode worker, as discovery names it
    rank: int
    reservation_token: str  # unguessable, made by the decode rank for this request


@dataclass
class ReservationQuery:
    """A prefill worker asks the decode worker it resolved for the reservation a prefill plan names."""

    rank: int
    request_id: str
    reservation_token: str


@dataclass
class Reservation:
    """The decode rank's answer, given once per reservation: where and until when the prefill rank may write."""

    agent_name: str
    agent_metadata: bytes  # what a writer needs to reach the decode rank's pool (memory keys): only to token holders
    page_ids: list[int]  # one per page of the prompt, in order
    skip_pages: int  # leading pages the decode rank already holds: not written
    # Wall-clock (Unix) time after which the prefill rank must not post the WRITE; a posted WRITE is cancelled after
    # `transfer_timeout_s`. The decode rank keeps a reservation it gave up on out of use until both have passed (plus
    # a margin), so a late WRITE cannot land in pages given to another request. Assumes host clocks agree to well
    # under a second (NTP).
    write_deadline_unix_s: float
    transfer_timeout_s: float


@dataclass
class Plan:
    """both: prefill and decode here. decode: reserve pages, have `prefill` fill them, then decode.
    prefill: compute the prompt, write its KV to `destination`, return the first token and finish."""

    kind: Literal["both", "prefill", "decode"] = "both"
    prefill: PrefillSource | None = None
    destination: KVDestination | None = None


@dataclass
class GenerateRequest:
    request_id: str
    rank: int
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    plan: Plan = field(default_factory=Plan)
    api_version: int = API_VERSION


@dataclass
class TokenEvent:
    """One line of a generate stream. The last line has finish_reason set."""

    request_id: str
    token_ids: list[int]
    text: str = ""  # detokenized delta, stop strings already cut
    logprobs: list[float] | None = None  # per token: the model's log-probability of the chosen token
    # per token: the most likely token ids and their log-probabilities, best first (when top_logprobs > 0)
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # An error of the hand-off's prefill side (unreachable, failed, too slow): the decode rank that sends it is fine
    # and may take the request again with another prefill rank.
    prefill_failed: bool = False
    # sampling.prompt_logprobs, on the first token's event: per prompt token (the first None), and the most likely
    # tokens at each position, best first (the first position's empty)
    prompt_logprobs: list[float | None] | None = None
    prompt_ranks: list[int] | None = None  # each prompt token's rank in the vocabulary there (the first 0)
    prompt_top_token_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None


def _joined(parts: list[list | None]) -> list | None:
    return None if all(part is None for part in parts) else [x for part in parts for x in part or ()]


def coalesce_events(events: list[TokenEvent]) -> list[TokenEvent]:
    """Consecutive events of one request as one event (a reader that fell behind takes them at once: one line to
    encode, send and decode instead of one per token). An error event stays on its own: it carries no tokens."""
    if len(events) <= 1:
        return events
    tail = [events[-1]] if events[-1].finish_reason == "error" else []
    run = events[:-1] if tail else events
    if len(run) <= 1:
        return events
    last = run[-1]
    merged = TokenEvent(
        last.request_id, [t for e in run for t in e.token_ids], "".join(e.text for e in run),
        _joined([e.logprobs for e in run]), _joined([e.top_token_ids for e in run]),
        _joined([e.top_logprobs for e in run]), last.finish_reason, last.error,
        max(e.prompt_tokens for e in run), max(e.cached_tokens for e in run))
    with_prompt = next((e for e in run if e.prompt_logprobs is not None), None)  # the first token's event
    if with_prompt is not None:
        merged.prompt_logprobs = with_prompt.prompt_logprobs
        merged.prompt_ranks = with_prompt.prompt_ranks
        merged.prompt_top_token_ids = with_prompt.prompt_top_token_ids
        merged.prompt_top_logprobs = with_prompt.prompt_top_logprobs
    return [merged, *tail]


def token_gap(previous_s: float | None, now_s: float, num_tokens: int) -> tuple[float, int]:
    """The inter-token gaps that `num_tokens` tokens arriving together at `now_s` stand for, as router and bench both
    count them, as (gap, how many): the time since the previous arrival spread evenly over them; with no previous
    arrival (the first token's event) the rest arrived with the first, a gap of 0 each. One gap per token after a
    request's first, however coalesce_events batched them."""
    if previous_s is None:
        return 0.0, max(num_tokens - 1, 0)
    return (now_s - previous_s) / num_tokens, num_tokens


def token_gaps(previous_s: float | None, now_s: float, num_tokens: int) -> tuple[float, ...]:
    """token_gap's gaps one by one."""
    gap, count = token_gap(previous_s, now_s, num_tokens)
    return (gap,) * count


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class RankLoad:
    rank: int
    running: int
    waiting: int
    free_pages: int
    total_pages: int
    prefix_cache_pages: int
    steps_completed: int = 0  # engine steps this rank has run since it started
    loop_stalled_s: float = 0.0  # how long the rank's step loop has been in one step or command (0 while it turns)
    warming_up: bool = False  # running its warm-up (a restarted rank): not ready for traffic yet
    queued_prompt_tokens: int = 0  # prompt tokens waiting or in prefill, still to compute
    prefill_tokens_per_s: float = 0.0  # prompt tokens the rank computed per second of its recent steps (0: none yet)
    decode_step_s: float = 0.0  # its recent decode-only steps' time while it has requests running (else 0)


@dataclass
class LoadReport:
    ranks: list[RankLoad]


@dataclass
class RankInfo:
    rank: int
    page_size: int
    num_pages: int
    agent_name: str
    warmup_s: float = 0.0  # how long the rank ran its warm-up before it reported ready
    prefill_chunk_tokens: int = 0  # the most prompt tokens a step computes beside running decodes (0: not told)


@dataclass
class WorkerInfo:
    api_version: int
    role: Role
    model: str
    max_model_len: int
    ranks: list[RankInfo]
    channel_port: int = 0  # where the worker serves its channel (generate streams, pdserve/wire/channel.py); 0: none


@dataclass
class WorkerHealth:
    status: Literal["ok", "draining", "unhealthy"]
    role: Role
    num_ranks: int


@dataclass
class KVEventBatch:
    rank: int
    seq: int  # increases by one per batch; a gap means events were lost: resync from a full dump
    events: list[KVEvent]
