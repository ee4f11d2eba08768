"""A rank's prefill speed as it serves: prompt tokens per second of the step-loop turns that computed them, as a
moving average. The router divides a prefill rank's queued prompt tokens by it (how long a new prompt would wait
there) and a prompt's tokens by it (how long prefilling it on a decode rank would stall that rank's decodes)."""

SMOOTHING = 0.25  # weight of the newest turn: a few prefill steps bring it to a new speed


class PrefillRate:
    def __init__(self) -> None:
        self.tokens_per_s = 0.0  # 0: no turn with prompt tokens measured yet
        self._open: tuple[float, int] | None = None  # (start, prompt tokens) of the turn under way

    def turn_started(self, started_s: float, prompt_tokens: int) -> None:
        """A step computing `prompt_tokens` (mixed steps' decodes count in its time, so the rate errs low)."""
        self._open = (started_s, prompt_tokens) if prompt_tokens else None

    def turn_ended(self, ended_s: float) -> None:
        """The turn ends where the next step starts or the loop goes idle: under overlapped scheduling a step's
        device work finishes inside the next call, so turn to turn is the step's time, not one call's."""
        if self._open is None:
            return
        (started_s, tokens), self._open = self._open, None
        if ended_s <= started_s:
            return
        rate = tokens / (ended_s - started_s)
        self.tokens_per_s = rate if not self.tokens_per_s else (1 - SMOOTHING) * self.tokens_per_s + SMOOTHING * rate
