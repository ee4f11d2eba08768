"""A rank's prefill speed as it serves: prompt tokens per second of the step-loop turns that computed prompt tokens,
as a moving average. The router divides a prefill rank's queued prompt tokens by it (how long a new prompt would
wait there) and a decode rank's queued prompt tokens, plus a prompt's, by the decode rank's (how long prefilling
it there would slow that rank's decodes). Decodes beside the prompt tokens count in a turn's time: on a decode rank
the rate then says how fast prompts go through its mixed steps, each of which every running decode waits for (a
rate of prefill-only turns, tried, let 4-6x as many prompts onto the decode rank in simulation, and its ITL p99
doubled)."""

SMOOTHING = 0.25  # weight of the newest turn: a few prefill steps bring it to a new speed


class PrefillRate:
    def __init__(self) -> None:
        self.tokens_per_s = 0.0  # 0: no turn with prompt tokens measured yet
        self._open: tuple[float, int] | None = None  # (start, prompt tokens) of the turn under way

    def turn_started(self, started_s: float, prompt_tokens: int) -> None:
        """A step computing `prompt_tokens` (0: a step that does not count)."""
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
