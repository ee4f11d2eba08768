"""What an engine reports of itself (queue lengths, pages, token counts, expert parallelism), kept apart from the
engine so that the worker edge, which only forwards these, need not import torch."""

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    running: int
    waiting: int
    held: int  # sequences held: running, waiting, or reserved for a KV transfer (reservations stop at max_num_seqs)
    free_pages: int
    total_pages: int
    prefix_cache_pages: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    prompt_tokens: int
    generation_tokens: int
    # Prompt tokens still to compute: waiting requests' (before any prefix-cache match) and running prefills' rest.
    queued_prompt_tokens: int = 0
    growth_pages: int = 0  # pages the held sequences' next tokens take, which a new reservation leaves free
    expert_weight_bytes: int = 0
    expert_exchange_overflows: int = 0  # fixed-capacity decode steps run again with split sizes
    expert_peer_writes: bool = False  # the fixed-capacity exchange writes into the peers' memory (else NCCL)
    # (token, expert) pairs this rank's tokens sent to each routed expert (global ids), summed over layers
    expert_tokens: list[int] = field(default_factory=list)
    expert_replica_slots_filled: int = 0
    host_cache_pages: int = 0  # pages the prefix cache's host tier holds
    host_cache_offloaded_pages: int = 0  # copied from the KV pool into the host tier, over the rank's life
    host_cache_loaded_pages: int = 0  # copied back, each a page of prompt not recomputed  # replica slots the instance's rebalances filled with a new expert (all ranks)
