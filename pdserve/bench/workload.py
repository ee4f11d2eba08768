"""A seeded serving workload: which token ids each request sends, how many tokens it asks for, and when it arrives.

Prompts are token ids, not text, so every length is exact and the best possible prefix-cache hit ratio can be
computed from the workload itself. Conversations re-send their history: turn k's prompt is turn k-1's prompt,
a stand-in assistant reply (drawn from the seed, so replays do not depend on what the server generated) and a
new user message.
"""

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LengthRange:
    """Token counts drawn uniformly from [low, high]."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"length range needs 0 <= low <= high, got [{self.low}, {self.high}]")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int
    seed: int = 0
    request_rate: float | None = None  # Poisson arrivals per second; None sends as fast as max_concurrency allows
    max_concurrency: int | None = None  # requests in flight at once; None is unbounded
    prompt_len: LengthRange = field(default_factory=lambda: LengthRange(128, 256))  # a user message
    output_len: LengthRange = field(default_factory=lambda: LengthRange(16, 64))
    long_fraction: float = 0.0  # share of conversations that are one long-document request instead
    long_prompt_len: LengthRange = field(default_factory=lambda: LengthRange(1024, 2048))
    num_prefix_groups: int = 0  # groups sharing a system prompt (conversations go to groups in turn); 0: none
    system_prompt_len: int = 0
    turns_per_conversation: int = 1
    # Token ids are drawn from [low, high): above the special tokens, below the model's vocabulary size.
    token_id_low: int = 3
    token_id_high: int = 500

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0 or None, got {self.request_rate}")
        if self.request_rate is None and self.max_concurrency is None:
            raise ValueError("give a request_rate, a max_concurrency, or both")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        if self.turns_per_conversation < 1:
            raise ValueError(f"turns_per_conversation must be >= 1, got {self.turns_per_conversation}")
        if self.num_prefix_groups and self.system_prompt_len < 1:
            raise ValueError("prefix groups need a system_prompt_len >= 1")
        if not 0 <= self.token_id_low < self.token_id_high:
            raise ValueError(f"token id range [{self.token_id_low}, {self.token_id_high}) is empty")


@dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival_s: float  # offset from the start of the run; the client may send later (concurrency, previous turn)
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    group: int | None  # shared-prefix group, None for requests without a system prompt
    conversation: int
    turn: int
    previous_turn: int | None  # index of the request this one continues; it is sent after that one finishes


def _tokens(rng: random.Random, count: int, cfg: WorkloadConfig) -> list[int]:
    return [rng.randrange(cfg.token_id_low, cfg.token_id_high) for _ in range(count)]


def generate_workload(cfg: WorkloadConfig) -> list[BenchRequest]:
    """The requests in arrival order. Conversations run side by side: every conversation's turn 0 comes before any
    turn 1, so requests of different groups arrive interleaved."""
    rng = random.Random(cfg.seed)
    system_prompts = [_tokens(rng, cfg.system_prompt_len, cfg) for _ in range(cfg.num_prefix_groups)]
    histories: list[list[int]] = []
    groups: list[int | None] = []
    is_long: list[bool] = []
    num_grouped = planned_requests = 0
    while planned_requests < cfg.num_requests:  # conversations until their turns cover num_requests
        is_long.append(rng.random() < cfg.long_fraction)
        group = None
        if system_prompts and not is_long[-1]:
            group, num_grouped = num_grouped % cfg.num_prefix_groups, num_grouped + 1
        groups.append(group)
        histories.append(list(system_prompts[group]) if group is not None else [])
        planned_requests += 1 if is_long[-1] else cfg.turns_per_conversation
    num_conversations = len(histories)

    requests: list[BenchRequest] = []
    last_request: dict[int, int] = {}
    arrival_s = 0.0
    for turn in range(cfg.turns_per_conversation):
        for conversation in range(num_conversations):
            if len(requests) == cfg.num_requests or (turn > 0 and is_long[conversation]):
                continue
            history = histories[conversation]
            if turn > 0:
                history.extend(_tokens(rng, cfg.output_len.draw(rng), cfg))  # the stand-in assistant reply
            user_len = (cfg.long_prompt_len if is_long[conversation] else cfg.prompt_len).draw(rng)
            history.extend(_tokens(rng, user_len, cfg))
            if cfg.request_rate is not None:
                arrival_s += rng.expovariate(cfg.request_rate)
            requests.append(BenchRequest(
                index=len(requests), arrival_s=arrival_s, prompt_token_ids=tuple(history),
                max_tokens=cfg.output_len.draw(rng), group=groups[conversation], conversation=conversation,
                turn=turn, previous_turn=last_request.get(conversation),
            ))
            last_request[conversation] = len(requests) - 1
    return requests


def best_prefix_hit_ratio(requests: list[BenchRequest], page_size: int) -> float:
    """Hit tokens over prompt tokens for one unbounded cache that has seen every earlier request in order: the
    ceiling any routing can reach. The engine matches full pages of all prompt tokens but the last (one token is
    always computed), so each request hits its longest page-aligned prefix shared with an earlier prompt."""
    cached_pages: set[int] = set()  # chained hashes: a page's hash covers every token before it
    hits = queries = 0
    for request in requests:
        prompt = request.prompt_token_ids
        queries += len(prompt)
        page_hashes, chained = [], 0
        for start in range(0, len(prompt) - page_size + 1, page_size):
            chained = hash((chained, prompt[start : start + page_size]))
            page_hashes.append(chained)
        matchable_pages = (len(prompt) - 1) // page_size
        matched = 0
        while matched < matchable_pages and page_hashes[matched] in cached_pages:
            matched += 1
        hits += matched * page_size
        cached_pages.update(page_hashes)
    return hits / queries if queries else 0.0
