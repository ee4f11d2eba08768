"""One request's state inside a rank's engine."""

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.engine.grammar import RequestGrammar
from pdserve.wire.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class PromptTokenLogprobs:
    """A prompt token's log-probability given the tokens before it, and the most likely tokens there, best first."""

    logprob: float
    rank: int  # 1 + how many tokens of the vocabulary were more likely there
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)  # pages holding this request's KV, in order
    num_computed_tokens: int = 0  # tokens whose KV is in page_ids
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    keep_pages_on_finish: bool = False  # prefill-only: pages live on until the KV transfer releases them
    grammar: RequestGrammar | None = None  # the constraint's matcher, advanced by every output token
    # Overlapped steps (engine.py): tokens sampled on the device whose ids have not reached the host yet; they count
    # as tokens (the next step computes their KV) but are not in output_token_ids until they are resolved.
    num_unresolved_tokens: int = 0
    ends_when_resolved: bool = False  # an unresolved token reaches a length limit: not scheduled again
    # sampling.prompt_logprobs: per prompt position (the first stays None), filled by the steps that compute them
    prompt_logprobs: list["PromptTokenLogprobs | None"] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.sampling.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The tokens known on the host (unresolved ones excluded)."""
        return self.prompt_token_ids + self.output_token_ids

    def known_token_ids(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without joining the whole list: a decode step asks each of its hundreds of
        sequences for one token of thousands (the join was ~10% of a busy decode rank's host samples)."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        split = len(prompt)
        if end <= split:
            return prompt[start:end]
        if start >= split:
            return output[start - split:end - split]
        return prompt[start:] + output[:end - split]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt token's log-probability is still to be computed. Chunks run in order, so the last
        token's is the last to come; a preempted request computes its prompt again and rewrites the same values."""
        return len(self.prompt_logprobs) > 1 and self.prompt_logprobs[-1] is None

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far, unresolved ones included."""
        return len(self.output_token_ids) + self.num_unresolved_tokens

    # Read several times per request and step: these two sum the lists' lengths themselves rather than call the
    # property above (a decode step of 256 sequences spent ~1.5 ms of host time in the chain).
    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_unresolved_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV must be computed before the next token can be sampled."""
        return (len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_unresolved_tokens
                - self.num_computed_tokens)

    @property
    def is_prefilling(self) -> bool:
        return self.num_pending_tokens > 1
