"""The planner's settings: one frozen dataclass, its flags derived from the fields (pdserve/settings/flags.py)."""

import argparse
from dataclasses import dataclass
from typing import Literal

from pdserve.engine.config import EngineConfig
from pdserve.settings.flags import add_flags, comma_list, from_flags, setting


@dataclass(frozen=True)
class PlannerConfig:
    # What it reads: the routers' /metrics.
    discovery: Literal["static", "k8s"] = setting("static", "where the routers are: --routers, or the pods Kubernetes "
                                                            "lists")
    router_urls: tuple[str, ...] = setting((), "comma-separated router URLs (static discovery)", flag="--routers",
                                           parse=comma_list)
    k8s_namespace: str = setting("default", "namespace of the routers' pods and the pools' StatefulSets")
    k8s_router_selector: str = setting("app.kubernetes.io/component=router", "label selector of router pods")
    # What it acts on.
    pools: Literal["kubernetes", "none"] = setting("kubernetes", "scale the pools' StatefulSets, or only log what it "
                                                                "would do (none)")
    prefill_statefulset: str = setting("pdserve-prefill", "the prefill pool's StatefulSet")
    decode_statefulset: str = setting("pdserve-decode", "the decode pool's StatefulSet")
    # The SLO and what a rank can do (the model's step profile on its GPU, as the simulated engine uses).
    slo_ttft_s: float = setting(2.0, "time-to-first-token p99 target")
    slo_itl_s: float = setting(0.05, "inter-token latency p99 target")
    profile: str = setting("", "step-time profile JSON of the served model on its GPU (default: DeepSeek-V2-Lite "
                               "on one H100)")
    prefill_chunk_tokens: int = setting(EngineConfig.max_num_batched_tokens, "tokens a prefill step takes (the "
                                        "workers' --max-num-batched-tokens; the default is theirs)")
    max_decode_batch: int = setting(256, "sequences a decode rank runs at once (the workers' --max-num-seqs)")
    prefill_utilization: float = setting(0.9, "most of a prefill rank's throughput to plan for; less where the TTFT "
                                              "target leaves prompts less room to queue")
    ttft_headroom: float = setting(0.8, "plan prefill so a prompt's modelled p99 queueing and prefill fit this share "
                                        "of the TTFT target")
    itl_headroom: float = setting(0.8, "plan decode steps of at most this share of the ITL target")
    prefill_ranks_per_worker: int = setting(1, "DP ranks of one prefill worker (pod)")
    decode_ranks_per_worker: int = setting(1, "DP ranks of one decode worker (pod)")
    min_prefill: int = setting(1, "fewest prefill workers")
    max_prefill: int = setting(8, "most prefill workers")
    min_decode: int = setting(1, "fewest decode workers")
    max_decode: int = setting(8, "most decode workers")
    # When it acts.
    interval_s: float = setting(30.0, "seconds between decisions")
    lookahead_s: float = setting(180.0, "plan for the load expected this far ahead (about a worker's start time)")
    scale_down_window_s: float = setting(300.0, "a pool shrinks only to the largest size needed over this window")

    def __post_init__(self) -> None:
        checks = [
            (self.slo_ttft_s > 0 and self.slo_itl_s > 0, "SLO targets must be > 0"),
            (0 < self.prefill_utilization <= 1 and 0 < self.ttft_headroom <= 1 and 0 < self.itl_headroom <= 1,
             "prefill_utilization, ttft_headroom and itl_headroom must be in (0, 1]"),
            (self.prefill_chunk_tokens >= 1 and self.max_decode_batch >= 1,
             "prefill_chunk_tokens and max_decode_batch must be >= 1"),
            (self.prefill_ranks_per_worker >= 1 and self.decode_ranks_per_worker >= 1, "ranks per worker must be >= 1"),
            (0 <= self.min_prefill <= self.max_prefill and 0 <= self.min_decode <= self.max_decode,
             "pool bounds need 0 <= min <= max"),
            (self.interval_s > 0 and self.lookahead_s >= 0 and self.scale_down_window_s >= 0,
             "interval_s must be > 0, lookahead_s and scale_down_window_s >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message} (got {self})")


def add_planner_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, PlannerConfig)


def planner_config_from_args(args: argparse.Namespace) -> PlannerConfig:
    return from_flags(PlannerConfig, args)
