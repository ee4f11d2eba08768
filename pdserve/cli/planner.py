"""`pdserve planner`: sizes the prefill and decode pools at the SLO and scales their StatefulSets (docs/planner.md)."""

import argparse


def add_planner_parser(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.planner.config import add_planner_arguments

    parser = subparsers.add_parser("planner", help="scale the prefill and decode pools to meet the SLO at least cost")
    add_planner_arguments(parser)
    parser.set_defaults(func=main_planner)


def main_planner(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from pdserve.discovery.endpoints import Discovery, KubernetesDiscovery, StaticDiscovery
    from pdserve.engine.step_profile import DEFAULT_PROFILE, StepProfile
    from pdserve.planner.config import planner_config_from_args
    from pdserve.planner.loop import router_urls_now, run_planner
    from pdserve.planner.policy import Planner, PoolSizes
    from pdserve.planner.pools import DryRunPools, KubernetesPools, Pools

    cfg = planner_config_from_args(args)
    routers: Discovery = (KubernetesDiscovery(cfg.k8s_namespace, cfg.k8s_router_selector) if cfg.discovery == "k8s"
                          else StaticDiscovery(cfg.router_urls))
    pools: Pools = (KubernetesPools(cfg.k8s_namespace, cfg.prefill_statefulset, cfg.decode_statefulset)
                    if cfg.pools == "kubernetes" else DryRunPools(PoolSizes(cfg.min_prefill, cfg.min_decode)))
    planner = Planner(cfg, StepProfile.load(cfg.profile or DEFAULT_PROFILE))
    logging.getLogger("pdserve.planner").setLevel(logging.INFO)  # its decisions are what it is run for
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"pdserve planner: every {cfg.interval_s:g} s, SLO TTFT p99 {cfg.slo_ttft_s:g} s, ITL p99 "
          f"{cfg.slo_itl_s * 1e3:g} ms; pools: {cfg.pools}", flush=True)
    try:
        run_planner(planner, pools, router_urls_now(lambda: [e.url for e in routers.endpoints()]), stop)
    finally:
        routers.close()
    return 0

