"""The garbage collector as a source of stalls. A full collection walks every object the collector tracks with the GIL
held; after start-up (the model, torch.compile's graphs and guards, captured CUDA graphs, loaded kernels; in the
worker's edge, the imports alone) that is a great many objects, and the rank's step in progress, or every stream the
edge forwards, stalls while it runs. `freeze_start_up_objects` moves every
object alive after warm-up out of the collector's sight (`gc.freeze`: start-up's objects live as long as the rank
anyway), and `GcClock` adds up the time collections take, which the step trace records per turn."""

import gc
import time


def freeze_start_up_objects() -> int:
    """Leave everything alive now out of later collections; returns how many objects that is."""
    gc.freeze()
    return gc.get_freeze_count()


class GcClock:
    """Seconds this process has spent collecting garbage since the clock was made (every generation, any thread:
    a collection holds the GIL, so it stalls them all)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started_s: float | None = None
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
        elif self._started_s is not None:
            self.seconds += time.perf_counter() - self._started_s
            self._started_s = None

    def close(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
