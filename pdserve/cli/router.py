"""`pdserve router`: the OpenAI-compatible front door."""

import argparse
import gc


def add_router_parser(subparsers: argparse._SubParsersAction) -> None:
    from pdserve_router.config import add_router_arguments

    parser = subparsers.add_parser("router", help="run the OpenAI-compatible router")
    add_router_arguments(parser)
    parser.set_defaults(func=main_router)


def main_router(args: argparse.Namespace) -> int:
    import uvicorn

    from pdserve.http.slow_clients import KEEP_ALIVE_S, SlowClientLimits
    from pdserve_router.app import build_router_app
    from pdserve_router.config import router_config_from_args
    from pdserve_router.hot_routes import hot_route_http

    config = router_config_from_args(args)
    print(f"pdserve router: serving {config.model_name} on http://{config.host}:{config.port}", flush=True)
    limits = SlowClientLimits(config.request_read_timeout_s, config.send_stall_timeout_s)
    app = build_router_app(config)
    # Start-up's objects (the tokenizer, templates, schemas) live as long as the process: a full collection walking
    # them holds the GIL and stalls every stream the router forwards (benchmarks/gc_pause.py measures one).
    gc.freeze()
    # On SIGTERM uvicorn stops accepting and lets the streams in flight finish, for at most drain_timeout_s.
    # No access log and no X-Forwarded-* rewriting: the router reads neither, and both cost every request.
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", http=hot_route_http(limits, app),
                timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=config.drain_timeout_s,
                access_log=False, proxy_headers=False)
    return 0
