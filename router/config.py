"""The router's configuration: one frozen dataclass built once from CLI flags (or by tests) and passed down."""

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

RoutingPolicy = Literal["prefix", "round_robin", "least_load"]
DiscoveryKind = Literal["static", "k8s"]


@dataclass(frozen=True)
class RouterConfig:
    model_dir: str  # holds tokenizer.json and tokenizer_config.json
    served_model_name: str = ""  # defaults to the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    discovery: DiscoveryKind = "static"
    worker_urls: tuple[str, ...] = ()
    k8s_namespace: str = "default"
    k8s_label_selector: str = "app.kubernetes.io/name=pdserve"
    routing: RoutingPolicy = "prefix"
    prefix_weight: float = 1.0
    load_weight: float = 0.5
    # Conditional disaggregation (LocalPrefillRule in router/policies.py); 0 tokens: every prompt goes to a prefill rank.
    local_prefill_max_tokens: int = 0
    local_prefill_min_queue: int = 1
    api_keys: frozenset[str] = field(default_factory=frozenset)  # empty: no authentication
    # Limits: what a request may ask for before it is refused with a 4xx.
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int = 4 * 1024 * 1024  # text to tokenize per request; more is a 400 before tokenizing starts
    text_threads: int = 2  # threads that tokenize and render chat templates off the event loop
    max_n: int = 16
    max_tokens_limit: int = 32768
    max_model_len: int = 0  # 0: taken from the workers' info (the smallest), else this
    # Admission: requests in flight beyond this get a 429 with Retry-After instead of waiting unboundedly.
    max_concurrent_requests: int = 1024
    max_streams_per_api_key: int = 256
    retry_after_s: int = 1
    # Workers: how fast a dead one is ejected and a returning one re-admitted.
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    eject_after_failures: int = 2  # checks that fail outright (refused, error status) before ejection
    eject_unresponsive_after_s: float = 10.0  # checks that time out: ejection after this long without an answer
    pending_assignment_ttl_s: float = 10.0  # router's own assignments count in the index this long
    max_attempts: int = 3  # ranks tried for a request that has produced no token yet
    max_migrations: int = 2  # times a stream moves to another decode path after its worker failed mid-stream
    first_token_timeout_s: float = 600.0  # bound on waiting for a worker's first token
    # Slow clients (pdserve/http/slow_clients.py): a request must arrive whole within this of its first byte, and a
    # response the client stops taking is cut after this long.
    request_read_timeout_s: float = 30.0
    send_stall_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        checks = [
            (self.routing in ("prefix", "round_robin", "least_load"), f"routing must be prefix|round_robin|least_load, got {self.routing!r}"),
            (self.discovery in ("static", "k8s"), f"discovery must be static|k8s, got {self.discovery!r}"),
            (self.prefix_weight >= 0 and self.load_weight >= 0, "prefix_weight and load_weight must be >= 0"),
            (self.local_prefill_max_tokens >= 0 and self.local_prefill_min_queue >= 0,
             "local_prefill_max_tokens and local_prefill_min_queue must be >= 0"),
            (self.max_attempts >= 1, "max_attempts must be >= 1"),
            (self.max_migrations >= 0, "max_migrations must be >= 0"),
            (self.eject_after_failures >= 1, "eject_after_failures must be >= 1"),
            (self.eject_unresponsive_after_s >= 0, "eject_unresponsive_after_s must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name


def read_api_keys(path: str) -> frozenset[str]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    lines = Path(path).read_text().splitlines()
    keys = frozenset(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise ValueError(f"API keys file {path} holds no key")
    return keys


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", required=True, help="model directory (tokenizer.json, tokenizer_config.json)")
    parser.add_argument("--served-model-name", default="", help="model name clients use (default: directory name)")
    parser.add_argument("--discovery", choices=["static", "k8s"], default="static")
    parser.add_argument("--workers", default="", help="comma-separated worker URLs (static discovery)")
    parser.add_argument("--k8s-namespace", default="default")
    parser.add_argument("--k8s-label-selector", default="app.kubernetes.io/name=pdserve")
    parser.add_argument("--routing", choices=["prefix", "round_robin", "least_load"], default="prefix")
    parser.add_argument("--prefix-weight", type=float, default=1.0)
    parser.add_argument("--load-weight", type=float, default=0.5)
    parser.add_argument("--local-prefill-max-tokens", type=int, default=0,
                        help="conditional disaggregation: prefill prompts of at most this many tokens on the "
                             "decode worker when the prefill rank is busy (0: off)")
    parser.add_argument("--local-prefill-min-queue", type=int, default=1,
                        help="...busy meaning at least this many requests running or waiting on it (0: always)")
    parser.add_argument("--eject-unresponsive-after-s", type=float, default=10.0,
                        help="eject a worker whose health checks time out only after this long (one that refuses "
                             "connections goes after 2 failed checks)")
    parser.add_argument("--api-keys-file", default="", help="file with one API key per line (default: no auth)")
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger request bodies get a 413")
    parser.add_argument("--max-prompt-chars", type=int, default=4 * 1024 * 1024,
                        help="a request with more prompt text than this gets a 400 before any tokenization starts")
    parser.add_argument("--request-read-timeout-s", type=float, default=30.0,
                        help="a request's head and body must arrive within this of its first byte, else 408")
    parser.add_argument("--send-stall-timeout-s", type=float, default=60.0,
                        help="a response the client stops reading for this long is cut")


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        model_dir=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        discovery=args.discovery,
        worker_urls=tuple(url.strip().rstrip("/") for url in args.workers.split(",") if url.strip()),
        k8s_namespace=args.k8s_namespace,
        k8s_label_selector=args.k8s_label_selector,
        routing=args.routing,
        prefix_weight=args.prefix_weight,
        load_weight=args.load_weight,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        local_prefill_min_queue=args.local_prefill_min_queue,
        eject_unresponsive_after_s=args.eject_unresponsive_after_s,
        api_keys=read_api_keys(args.api_keys_file) if args.api_keys_file else frozenset(),
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        request_read_timeout_s=args.request_read_timeout_s,
        send_stall_timeout_s=args.send_stall_timeout_s,
    )
