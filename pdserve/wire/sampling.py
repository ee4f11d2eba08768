"""Per-request sampling settings: what the offline API takes and what crosses the worker API as JSON."""

from dataclasses import dataclass, field
from typing import Literal

MAX_TOP_LOGPROBS = 20


@dataclass
class Grammar:
    """A constraint on the generated text, compiled by the engine (llguidance) into a token mask per step.
    `json_schema`: `source` is a JSON Schema (compact JSON, no free whitespace); `lark`: a Lark grammar in
    llguidance's dialect (special tokens as `<[id]>`, JSON Schemas embedded with `%json`)."""

    kind: Literal["json_schema", "lark"]
    source: str


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False  # return the log-probability of each chosen token
    top_logprobs: int = 0  # and of this many most likely tokens at each position (0..20)
    # The log-probability of each prompt token after the first, and of this many most likely tokens at each position
    # (0..20); None: not computed. Such a prompt is computed whole (a prefix-cache match has no logits).
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted once from every token already in the output (OpenAI)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output (OpenAI)
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits of these token ids
    grammar: Grammar | None = None
    # The prompt's last this many tokens are this request's own output, made on another worker (a stream migrated
    # after it died): they count as output (penalties, the grammar's matcher), and a seeded request's draws for
    # them are skipped, so the tokens that follow are those of an undisturbed run. max_tokens and min_tokens are
    # what is left.
    continued_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (off) or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (self.continued_tokens >= 0, "continued_tokens must be >= 0"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"prompt_logprobs must be None or in [0, {MAX_TOP_LOGPROBS}]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]"),
            (all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
