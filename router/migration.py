"""One generation's continuation across workers: what was streamed so far, and the request that continues it on
another worker when its worker dies mid-stream (prompt + streamed tokens, max_tokens and min_tokens reduced).

Text after a migration comes from the router's own detokenizer, replayed over everything streamed: the new worker
sees the streamed tokens as prompt, so its detokenizer starts fresh and neither knows the text held back by the dead
worker (an unfinished character, the start of a stop string) nor can find a stop string across the boundary.
The router's detokenizer runs the worker's algorithm over the same token sequence, so the text is what one
undisturbed worker would have sent."""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.wire.protocol import TokenEvent
from pdserve.wire.sampling import SamplingParams

DetokenizerFactory = Callable[[list[int], list[str]], IncrementalDetokenizer]  # (prompt ids, stop strings)


@dataclass
class Continuation:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    make_detokenizer: DetokenizerFactory
    streamed_token_ids: list[int] = field(default_factory=list)
    migrations: int = 0
    _detokenizer: IncrementalDetokenizer | None = None

    @property
    def started(self) -> bool:
        return bool(self.streamed_token_ids)

    def next_prompt(self) -> list[int]:
        return self.prompt_token_ids + self.streamed_token_ids

    def next_sampling(self) -> SamplingParams:
        done = len(self.streamed_token_ids)
        if not done:  # a first attempt, or a retry before any token: as asked (no copy, no re-validation)
            return self.sampling
        return replace(self.sampling, max_tokens=self.sampling.max_tokens - done,
                       min_tokens=max(0, self.sampling.min_tokens - done), continued_tokens=done,
                       prompt_logprobs=None)  # the first worker's first event brought them

    def migrate(self) -> None:
        """The next worker continues the stream: from now on the router makes the text."""
        self.migrations += 1
        if self._detokenizer is None:
            self._detokenizer = self.make_detokenizer(self.prompt_token_ids, self.sampling.stop)
            for token_id in self.streamed_token_ids:
                self._detokenizer.push([token_id])

    def absorb(self, event: TokenEvent) -> TokenEvent:
        """A worker's (non-error) event as the client gets it; after a migration its text is the router's own,
        and a stop string the router finds ends the generation (finish_reason "stop")."""
        if self._detokenizer is None:
            self.streamed_token_ids.extend(event.token_ids)
            return event
        text, kept = "", 0
        stopped = False
        for token_id in event.token_ids:
            delta, stopped = self._detokenizer.push([token_id])
            text += delta
            kept += 1
            if stopped:  # as a worker does: the token that completes a stop string is the last one
                break
        token_ids = event.token_ids[:kept]
        self.streamed_token_ids.extend(token_ids)
        finish_reason = "stop" if stopped else event.finish_reason
        if finish_reason is not None and not stopped:
            text += self._detokenizer.flush()
        logprobs = event.logprobs[:kept] if event.logprobs else event.logprobs
        return replace(event, token_ids=token_ids, text=text, finish_reason=finish_reason, logprobs=logprobs)
