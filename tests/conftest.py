"""Shared fixtures: tiny random checkpoints that pdserve generates itself (no downloads)."""

import os
import secrets

# One CPU thread for torch in every test process and every process a test starts (set before torch is imported), as
# the rank actors run: two pytest processes on a 2-core machine, each with a thread per core and the clusters they
# start beside them, oversubscribed the cores (torch's idle threads spin), and CPU-bound tests ran 4x slower
# (docs/benchmarks.md, "Test suite time").
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402 - after the thread count
import torch  # noqa: E402

from pdserve.http.internal_auth import TOKEN_ENV  # noqa: E402
from pdserve.model.tiny import make_tiny_model

# One internal-API credential for the whole run: every cluster a test starts hands it to its processes, and tests
# that call a worker's internal API directly send it (tests/probes.py: internal_headers). Set before anything starts.
os.environ.setdefault(TOKEN_ENV, secrets.token_urlsafe(32))
from tests.tiny_tokenizer import tiny_model_dir  # noqa: F401 - a fixture for text and router tests

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # also where torch came in before this file (a plugin)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """make(arch, seed=0, **overrides) -> directory; cached per argument set for the whole session."""
    made: dict[tuple, str] = {}

    def make(arch: str = "v2", seed: int = 0, fp8: bool = False, tokenizer: str = "tiny", **overrides) -> str:
        key = (arch, seed, fp8, tokenizer, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = str(make_tiny_model(out, arch=arch, seed=seed, overrides=overrides or None, fp8=fp8,
                                            tokenizer=tokenizer))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_v2(tiny_model_factory) -> str:
    return tiny_model_factory("v2")


@pytest.fixture(scope="session")
def tiny_v3(tiny_model_factory) -> str:
    return tiny_model_factory("v3")


@pytest.fixture(scope="session")
def tiny_v3_deepseek(tiny_model_factory) -> str:
    """A tiny V3 checkpoint with DeepSeek's real tokenizer (129,280-token vocabulary) and V3-format chat template."""
    return tiny_model_factory("v3", tokenizer="deepseek")


@pytest.fixture(scope="session")
def ray_address():
    """One local Ray instance for every cluster a test run starts (each worker process joins it)."""
    import logging

    import ray

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False, logging_level=logging.WARNING,
             namespace="pdserve-tests")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def pd_cluster(tiny_v2):
    """A router with one prefill, one decode and one colocated (both) worker, float32, on the tiny V2 model, all in
    this process (pdserve/cluster/inprocess.py); tests that kill, freeze or drain a process start a LocalCluster.
    Slow-client bounds are short (3 s) so that tests/reliability/test_slow_clients.py need not wait out the defaults."""
    from pdserve.cluster.inprocess import InProcessCluster
    from pdserve.cluster.layout import ClusterConfig

    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1, num_both=1,
                        worker_args=("--dtype", "float32", "--num-pages", "512", "--request-read-timeout-s", "3"),
                        router_args=("--request-read-timeout-s", "3", "--send-stall-timeout-s", "3"))
    with InProcessCluster(cfg) as cluster:
        yield cluster
