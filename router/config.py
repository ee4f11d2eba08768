"""The router's configuration: one frozen dataclass built once from CLI flags (or by tests) and passed down."""

import argparse
import os
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Literal

from pdserve.http.internal_auth import internal_token_from
from pdserve.settings.flags import add_flags, comma_list, from_flags, setting

RoutingPolicy = Literal["prefix", "round_robin", "least_load"]
DiscoveryKind = Literal["static", "file", "k8s"]


def worker_url_list(text: str) -> tuple[str, ...]:
    return tuple(url.rstrip("/") for url in comma_list(text))


@dataclass(frozen=True)
class RouterConfig:
    model_dir: str = setting(MISSING, "model directory (tokenizer.json, tokenizer_config.json)", flag="--model")
    served_model_name: str = setting("", "model name clients use (default: the model directory's name)")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    discovery: DiscoveryKind = setting("static", "where workers come from: --workers, --workers-file, or the pods "
                                                 "Kubernetes lists")
    worker_urls: tuple[str, ...] = setting((), "comma-separated worker URLs (static discovery)", flag="--workers",
                                           parse=worker_url_list)
    workers_file: str = setting("", "file of worker URLs, one per line, read again when it changes (file discovery)")
    k8s_namespace: str = setting("default", "namespace whose pods are workers (k8s discovery)")
    k8s_label_selector: str = setting("app.kubernetes.io/name=pdserve", "label selector of worker pods (k8s discovery)")
    routing: RoutingPolicy = setting("prefix", "how a request's prefill rank is chosen")
    prefix_weight: float = setting(1.0, "prefix routing: weight of the cached share of the prompt")
    load_weight: float = setting(0.5, "prefix routing: weight of the rank's load")
    # Conditional disaggregation (LocalPrefillRule in router/policies.py).
    local_prefill_max_tokens: int = setting(0, "conditional disaggregation: prefill prompts of at most this many "
                                               "tokens on the decode worker when the prefill rank is busy (0: off)")
    local_prefill_min_queue: int = setting(1, "...busy meaning at least this many requests running or waiting on it "
                                              "(0: always)")
    local_prefill_min_wait_ms: float = setting(0.0, "...and prompt tokens queued there for at least this long at its "
                                                    "measured prefill speed (0: no test)")
    local_prefill_max_stall_ms: float = setting(0.0, "...if the decode rank's steps, its decode step plus a chunk of "
                                                     "the prompts it computes (its --mixed-prefill-tokens), last at "
                                                     "most this long and it is done with the prompt sooner than the "
                                                     "prefill rank would be (0: no test)")
    local_prefill_long_step_share: float = setting(0.0, "...or, with longer steps, if those keep within this share of "
                                                        "the decode rank's steps (0: none)")
    prefill_fallback: bool = setting(True, "when no prefill rank can take a request (none routable, or each one "
                                           "tried), its decode rank prefills it rather than the request failing")
    separate_reasoning: bool = setting(True, "a thinking model's reasoning (DeepSeek-R1, V3.1 thinking: <think>...</think>) "
                                             "comes back apart from its answer, as reasoning_content; off: the text "
                                             "as generated")
    api_keys: frozenset[str] = field(default_factory=frozenset)  # empty: no authentication (--api-keys-file)
    # Limits: what a request may ask for before it is refused with a 4xx.
    max_body_bytes: int = setting(4 * 1024 * 1024, "larger request bodies get a 413")
    max_prompt_chars: int = setting(4 * 1024 * 1024, "a request with more prompt text than this gets a 400 before "
                                                     "any tokenization starts")
    text_threads: int = setting(2, "threads that tokenize and render chat templates off the event loop")
    max_n: int = setting(16, "largest n (choices per request)")
    max_tokens_limit: int = setting(32768, "largest max_tokens a request may ask for")
    max_model_len: int = setting(0, "context length (0: the smallest the workers report)")
    # Admission: requests in flight beyond this get a 429 with Retry-After instead of waiting unboundedly.
    max_concurrent_requests: int = setting(1024, "requests in flight beyond this get a 429")
    max_streams_per_api_key: int = setting(256, "requests in flight per API key beyond this get a 429")
    retry_after_s: int = setting(1, "Retry-After of a 429")
    # Workers: how fast a dead one is ejected and a returning one re-admitted.
    health_interval_s: float = setting(1.0, "seconds between health checks of each worker")
    health_timeout_s: float = setting(1.0, "bound on one health check")
    eject_after_failures: int = setting(2, "checks that fail outright (refused, error status) before ejection")
    eject_unresponsive_after_s: float = setting(10.0, "eject a worker whose health checks time out only after this "
                                                      "long without an answer")
    pending_assignment_ttl_s: float = setting(10.0, "the router's own assignments count in its prefix index this long")
    max_attempts: int = setting(3, "ranks tried for a request that has produced no token yet")
    max_migrations: int = setting(2, "times a stream moves to another decode path after its worker failed mid-stream")
    first_token_timeout_s: float = setting(600.0, "bound on waiting for a worker's first token")
    # Slow clients (pdserve/http/slow_clients.py).
    request_read_timeout_s: float = setting(30.0, "a request's head and body must arrive within this of its first "
                                                  "byte, else 408")
    send_stall_timeout_s: float = setting(60.0, "a response the client stops reading for this long is cut")
    drain_timeout_s: float = setting(30.0, "on SIGTERM, streams in flight get this long to finish")
    # The deployment's shared secret for the workers' internal API (pdserve/http/internal_auth.py), from
    # --internal-token-file or the environment, never a flag's value.
    internal_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        checks = [
            (self.routing in ("prefix", "round_robin", "least_load"), f"routing must be prefix|round_robin|least_load, got {self.routing!r}"),
            (self.discovery in ("static", "file", "k8s"), f"discovery must be static|file|k8s, got {self.discovery!r}"),
            (self.prefix_weight >= 0 and self.load_weight >= 0, "prefix_weight and load_weight must be >= 0"),
            (min(self.local_prefill_max_tokens, self.local_prefill_min_queue, self.local_prefill_min_wait_ms,
                 self.local_prefill_max_stall_ms) >= 0,
             "local_prefill_max_tokens, _min_queue, _min_wait_ms and _max_stall_ms must be >= 0"),
            (0 <= self.local_prefill_long_step_share <= 1, "local_prefill_long_step_share must be in [0, 1]"),
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
    add_flags(parser, RouterConfig)
    parser.add_argument("--api-keys-file", default="", help="file with one API key per line (default: no auth)")
    parser.add_argument("--internal-token-file", default="",
                        help="file holding the workers' internal-API credential (default: $PDSERVE_INTERNAL_TOKEN, "
                             "else a per-user file shared with workers started on this machine)")


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    return from_flags(RouterConfig, args,
                      api_keys=read_api_keys(args.api_keys_file) if args.api_keys_file else frozenset(),
                      internal_token=internal_token_from(args.internal_token_file, os.environ))
