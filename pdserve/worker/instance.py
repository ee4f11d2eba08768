"""One expert-parallel instance: R rank actors that form a process group, started and restarted together.

A rank that dies cannot rejoin its peers' process group, so Ray does not restart single ranks here: the worker's
health watch calls `restart()`, which kills every rank and forms the group anew on a fresh port.
"""

import asyncio
import logging

import ray

from pdserve.worker.rank_actors import RANK_START_TIMEOUT_S, RankHandle, place_ranks, start_actors
from pdserve.worker.rank_config import RankConfig

log = logging.getLogger(__name__)


class ExpertParallelInstance:
    def __init__(self, rank_configs: list[RankConfig], gpus_per_rank: float):
        self.rank_configs = rank_configs
        self.gpus_per_rank = gpus_per_rank
        self.group = place_ranks(len(rank_configs), gpus_per_rank)
        self.handles: list[RankHandle] = []
        self.restarts = 0

    async def start(self) -> list[RankHandle]:
        handles = start_actors(self.group, self.rank_configs, self.gpus_per_rank, max_restarts=0)
        self.handles = handles
        address = await handles[0].rendezvous_address(RANK_START_TIMEOUT_S)
        await asyncio.gather(*(h.join(address, RANK_START_TIMEOUT_S) for h in handles))
        log.info("expert-parallel instance of %s ranks formed at %s", len(handles), address)
        return handles

    async def restart(self) -> list[RankHandle]:
        """Kill every rank (in-flight streams end with an error) and form the instance again."""
        self.restarts += 1
        log.warning("restarting the expert-parallel instance (restart %s)", self.restarts)
        for handle in self.handles:
            try:
                handle.kill()
            except ray.exceptions.RayError:  # already gone
                pass
        return await self.start()
