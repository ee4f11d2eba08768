"""A rank's configuration and what it reports, the types that cross between the worker edge and its ranks (Ray
actors or ranks in process): torch-free, so the edge, which only forwards requests and these, does not import it."""

from dataclasses import dataclass, field

from pdserve.disagg.counters import HandoffCounters
from pdserve.disagg.receiver import CLOCK_MARGIN_S
from pdserve.engine.config import EngineConfig
from pdserve.engine.stats import EngineStats
from pdserve.wire.protocol import Role


@dataclass(frozen=True)
class RankConfig:
    rank: int
    role: Role
    engine: EngineConfig
    worker_url: str  # how peers' discovery names this rank's worker
    transfer_timeout_s: float = 30.0
    prefill_timeout_s: float = 120.0
    world_size: int = 1  # ranks of this worker
    expert_parallel: bool = False  # the ranks share the routed experts over the default process group
    internal_token: str = field(default="", repr=False)  # sent on this rank's calls to prefill workers
    nixl_progress_thread: bool | None = None  # None: on for a GPU pool, off on the CPU (docs/transfer.md)
    warmup: bool = True  # run every kernel variant once before the rank reports ready
    gil_switch_interval_s: float = 0.00005  # sys.setswitchinterval of the rank's process (see RankActor)
    test_step_delay_s: float = 0.0  # test hook: after warm-up each step first sleeps this long (a slow kernel)
    clock_margin_s: float = CLOCK_MARGIN_S  # how far host clocks may disagree, for write deadlines
    step_trace: str = ""  # trace each busy step to this path's `.{role}.rank{rank}` file once warmed up (step_trace.py)


@dataclass
class RankStats:
    """What a rank reports for the worker's metrics, across the Ray boundary (msgspec-encoded)."""

    engine: EngineStats
    counters: HandoffCounters
