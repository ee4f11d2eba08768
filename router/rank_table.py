"""Every known rank's load in arrays, kept current as polls and the router's own assignments arrive, and the
candidate lists a routing decision reads them through. A decision at hundreds of ranks then gathers two contiguous
arrays (handed to the policy as lists) instead of visiting a load record per rank, which costs far more when the CPU
caches are cold (in service, other requests' work runs between two decisions)."""

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pdserve.wire.protocol import RankInfo, RankLoad
from pdserve_router.policies import CandidateLoads
from pdserve_router.prefix_index import RankKey


@dataclass(frozen=True)
class Candidates:
    """Ranks that may take a request, in a stable order, and where each one's load lives in the table."""

    keys: list[RankKey]
    slots: np.ndarray  # intp: each key's row in the table's arrays
    position: dict[RankKey, int]  # key -> its index in `keys`

    def without(self, excluded: set[RankKey]) -> "Candidates":
        kept = [i for i, key in enumerate(self.keys) if key not in excluded]
        keys = [self.keys[i] for i in kept]
        return Candidates(keys, self.slots[kept], {key: i for i, key in enumerate(keys)})


def page_use(load: RankLoad) -> float:
    return 1.0 - load.free_pages / load.total_pages if load.total_pages else 0.0


class RankTable:
    def __init__(self) -> None:
        self._slot_of: dict[RankKey, int] = {}
        self._queue = np.zeros(0, dtype=np.int64)
        self._page_use = np.zeros(0)
        self._queued_prompt_tokens = np.zeros(0, dtype=np.int64)
        self._prefill_rate = np.zeros(0)  # prompt tokens per second; 0: not measured yet
        self._decode_step_s = np.zeros(0)  # 0: not measured yet, or nothing running
        self._chunk_tokens: list[int] = []  # RankInfo.prefill_chunk_tokens

    def rebuild(self, ranks: Iterable[tuple[RankKey, RankInfo, RankLoad | None]]) -> None:
        """A row per rank (the ranks known now, with their info and last polled load; None: not polled yet, idle).
        The assignments counted since each rank's last poll are dropped: the next poll brings them back."""
        ranks = list(ranks)
        loads = [load for _, _, load in ranks]
        self._slot_of = {key: slot for slot, (key, _, _) in enumerate(ranks)}
        self._chunk_tokens = [info.prefill_chunk_tokens for _, info, _ in ranks]
        self._queue = np.array([load.running + load.waiting if load else 0 for load in loads], dtype=np.int64)
        self._page_use = np.array([page_use(load) if load else 0.0 for load in loads], dtype=np.float64)
        self._queued_prompt_tokens = np.array([load.queued_prompt_tokens if load else 0 for load in loads],
                                              dtype=np.int64)
        self._prefill_rate = np.array([load.prefill_tokens_per_s if load else 0.0 for load in loads], dtype=np.float64)
        self._decode_step_s = np.array([load.decode_step_s if load else 0.0 for load in loads], dtype=np.float64)

    def candidates(self, keys: list[RankKey]) -> Candidates:
        """`keys` must all have rows (be known at the last rebuild)."""
        slots = np.array([self._slot_of[key] for key in keys], dtype=np.intp)
        return Candidates(keys, slots, {key: i for i, key in enumerate(keys)})

    def loads_of(self, candidates: Candidates) -> CandidateLoads:
        return CandidateLoads(self._queue[candidates.slots].tolist(), self._page_use[candidates.slots].tolist())

    def set_load(self, key: RankKey, load: RankLoad) -> None:
        slot = self._slot_of.get(key)
        if slot is not None:
            self._queue[slot] = load.running + load.waiting
            self._page_use[slot] = page_use(load)
            self._queued_prompt_tokens[slot] = load.queued_prompt_tokens
            self._prefill_rate[slot] = load.prefill_tokens_per_s
            self._decode_step_s[slot] = load.decode_step_s

    def add_waiting(self, key: RankKey, prompt_tokens: int) -> None:
        """The router just sent the rank a request: counted as queued (and its prompt as prompt tokens to compute)
        until its next poll replaces the load."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._queue[slot] += 1
            self._queued_prompt_tokens[slot] += prompt_tokens

    def prefill_backlog(self, key: RankKey) -> tuple[int, float]:
        """(prompt tokens queued on the rank, its measured prefill tokens per second, 0 if not yet measured)."""
        slot = self._slot_of.get(key)
        if slot is None:
            return 0, 0.0
        return int(self._queued_prompt_tokens[slot]), float(self._prefill_rate[slot])

    def decode_backlog(self, key: RankKey) -> tuple[int, float, int]:
        """(prompt tokens queued on the rank, its decode step's seconds, 0 if not measured or idle, the most prompt
        tokens a step of it computes beside decodes, 0 if not told)."""
        slot = self._slot_of.get(key)
        if slot is None:
            return 0, 0.0, 0
        return int(self._queued_prompt_tokens[slot]), float(self._decode_step_s[slot]), self._chunk_tokens[slot]
