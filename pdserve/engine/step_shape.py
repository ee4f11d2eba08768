"""The shape of one scheduled step as step timing sees it: how many sequences decode one token and at what mean
context, and how many prompt tokens (of how many sequences) are computed beside them. The simulated engine prices a
step by its shape (simulated.py); the step trace records it next to the step's measured time (step_trace.py)."""

from dataclasses import dataclass

from pdserve.engine.scheduler import ScheduledSeq


@dataclass(frozen=True)
class StepShape:
    decode_batch: int = 0  # sequences computing one token after the one they sampled last
    decode_context: float = 0.0  # their mean context, the new token included (0 without decodes)
    prefill_tokens: int = 0  # every other token of the step: prompt chunks, recomputed sequences
    prefill_seqs: int = 0  # sequences those tokens belong to

    @property
    def ran_work(self) -> bool:
        return self.decode_batch > 0 or self.prefill_tokens > 0


def step_shape(scheduled: list[ScheduledSeq]) -> StepShape:
    """The shape of `scheduled`, taken before the step advances its sequences (their computed tokens are then the
    context before the step). A one-token chunk of a sequence that has sampled is a decode; anything else (a prompt
    chunk, a whole prompt but its last token cached, a preempted sequence recomputed) is prefill."""
    decodes = [seq for seq in scheduled if seq.num_new_tokens == 1 and seq.request.num_output_tokens]
    prefill_tokens = sum(seq.num_new_tokens for seq in scheduled) - len(decodes)
    context = sum(seq.request.num_computed_tokens + 1 for seq in decodes) / len(decodes) if decodes else 0.0
    return StepShape(len(decodes), context, prefill_tokens, len(scheduled) - len(decodes))
