"""A rank's speeds as it serves, each a moving average over step-loop turns, for the router's conditional
disaggregation (router/policies.py, LocalPrefillRule):
- prompt tokens per second of the turns that computed prompt tokens: a prefill rank's queued prompt tokens divided
  by it say how long a new prompt would wait there, and a prompt divided by it how long computing it takes;
- seconds of a turn that only decoded: a decode rank's step, which every running request waits out as one
  inter-token gap, and which a prompt chunk computed beside the decodes lengthens by the chunk's time."""

from pdserve.engine.step_shape import StepShape

SMOOTHING = 0.25  # weight of the newest turn: a few steps bring a figure to a new speed


def _smoothed(average: float, newest: float) -> float:
    return newest if not average else (1 - SMOOTHING) * average + SMOOTHING * newest


class StepSpeeds:
    def __init__(self) -> None:
        self.prefill_tokens_per_s = 0.0  # 0: no turn with prompt tokens measured yet
        self.decode_step_s = 0.0  # 0: no decode-only turn measured yet
        self._open: tuple[float, StepShape] | None = None  # (start, shape) of the turn under way

    def turn_started(self, started_s: float, shape: StepShape) -> None:
        """A step that computed `shape` (one with neither prompt tokens nor decodes does not count)."""
        self._open = (started_s, shape) if shape.prefill_tokens or shape.decode_batch else None

    def turn_ended(self, ended_s: float) -> None:
        """The turn ends where the next step starts or the loop goes idle: under overlapped scheduling a step's
        device work finishes inside the next call, so turn to turn is the step's time, not one call's."""
        if self._open is None:
            return
        (started_s, shape), self._open = self._open, None
        if ended_s <= started_s:
            return
        if shape.prefill_tokens:
            self.prefill_tokens_per_s = _smoothed(self.prefill_tokens_per_s, shape.prefill_tokens / (ended_s - started_s))
        else:
            self.decode_step_s = _smoothed(self.decode_step_s, ended_s - started_s)
