"""Router, prefill and decode as three containers of the images deploy/containers/build.sh makes, each in its own
network namespace on a podman network, so HTTP and NIXL/UCX cross real interfaces. Greedy completions through the
router must equal the offline engine's tokens on the same tiny model, the prefill worker must have written KV to
the decode worker, and the router image must not hold torch. Exit status 0 when all of that holds.

    bash deploy/containers/build.sh && python deploy/containers/three_containers.py
"""

import argparse
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from pdserve import LLM, SamplingParams
from pdserve.http.ports import free_port
from pdserve.http.internal_auth import TOKEN_ENV
from pdserve.model.tiny import make_tiny_model

WORKER_PORT = 8100
MAX_TOKENS = 12


def podman(*args: str, check: bool = True, env: dict | None = None, timeout_s: float = 600) -> str:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=timeout_s)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ... failed ({result.returncode}): {result.stderr[-2000:]}")
    return result.stdout


def wait_ready(url: str, containers: list[str], num_workers: int, timeout_s: float) -> None:
    """Until the router routes to every worker: it is ready with the decode worker alone (the prefill fallback), and
    a request served before the prefill worker is would move no KV."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            workers = httpx.get(url + "/health", timeout=2).json().get("workers", {})
            if sum(state == "ok" for state in workers.values()) >= num_workers:
                return
        except (httpx.HTTPError, ValueError):  # not up yet, or not JSON yet
            pass
        for name in containers:  # a container that died will never become ready
            if podman("container", "inspect", "--format", "{{.State.Running}}", name, check=False).strip() != "true":
                raise RuntimeError(f"container {name} stopped:\n{podman('logs', name, check=False)[-3000:]}")
        time.sleep(1)
    raise TimeoutError(f"router not ready within {timeout_s} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-image", default="localhost/pdserve-cpu:dev")
    parser.add_argument("--router-image", default="localhost/pdserve-router:dev")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--start-timeout-s", type=float, default=420.0)
    args = parser.parse_args()
    started = time.monotonic()
    tag = f"pdserve-ci-{os.getpid()}"
    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix=tag)) / "model")
    for path in [model_dir.parent, model_dir, *model_dir.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # readable by the images' unprivileged user
    # The credential reaches the containers through podman's environment, never its command line (`-e NAME` copies it).
    env = {**os.environ, TOKEN_ENV: secrets.token_urlsafe(32)}
    router_port = free_port()
    network, names = tag, {role: f"{tag}-{role}" for role in ("prefill", "decode", "router")}
    peers = f"http://prefill:{WORKER_PORT},http://decode:{WORKER_PORT}"  # static discovery of hand-off peers
    podman("network", "create", network)
    try:
        for role in ("prefill", "decode"):
            podman("run", "-d", "--name", names[role], "--network", network, "--network-alias", role, "--shm-size", "1g",
                   "-v", f"{model_dir}:/model:ro", "-e", TOKEN_ENV, args.cpu_image,
                   "worker", "--role", role, "--model", "/model", "--host", "0.0.0.0", "--port", str(WORKER_PORT),
                   "--advertise-url", f"http://{role}:{WORKER_PORT}", "--peers", peers,
                   "--dtype", "float32", "--num-pages", "256",
                   env=env)
        podman("run", "-d", "--name", names["router"], "--network", network, "-p", f"127.0.0.1:{router_port}:8000",
               "-v", f"{model_dir}:/model:ro", "-e", TOKEN_ENV, args.router_image,
               "router", "--model", "/model", "--host", "0.0.0.0", "--port", "8000",
               "--workers", peers, env=env)
        url = f"http://127.0.0.1:{router_port}"
        wait_ready(url, list(names.values()), 2, args.start_timeout_s)
        print(f"[{time.monotonic() - started:5.0f} s] three containers up; router ready at {url}", flush=True)

        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 400, (n,), generator=generator).tolist() for n in (5, 17, 40, 64)][: args.requests]
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        expected = [r.token_ids for r in LLM(str(model_dir), progress=False, dtype="float32").generate(
            prompt_token_ids=prompts, sampling=greedy)]
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for prompt, tokens in zip(prompts, expected):
            response = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            response.raise_for_status()
            served = response.json()["choices"][0]["token_ids"]
            assert served == tokens, f"prompt of {len(prompt)} tokens: served {served}, offline engine {tokens}"
        print(f"[{time.monotonic() - started:5.0f} s] {len(prompts)} greedy completions equal the offline engine's",
              flush=True)

        metrics = podman("exec", names["decode"], "python3", "-c",
                         f"import httpx; print(httpx.get('http://prefill:{WORKER_PORT}/metrics').text)")
        written = sum(float(v) for v in re.findall(r"^pdserve_kv_transfer_bytes_total\{[^}]*\} (\S+)$", metrics, re.M))
        assert written > 0, "the prefill worker wrote no KV to the decode worker"
        refused = podman("exec", names["decode"], "python3", "-c",
                         f"import httpx; print(httpx.get('http://prefill:{WORKER_PORT}/internal/v1/load').status_code)")
        assert refused.strip() == "401", f"internal API without the credential answered {refused.strip()}"
        torch_import = subprocess.run(["podman", "run", "--rm", "--entrypoint", "python3", args.router_image, "-c",
                                       "import torch"], capture_output=True, text=True, timeout=120)
        assert "No module named 'torch'" in torch_import.stderr, "the router image holds torch"
        print(f"[{time.monotonic() - started:5.0f} s] KV crossed namespaces ({written:.0f} bytes), the internal API "
              "refused a caller without the credential, the router image has no torch: OK", flush=True)
        return 0
    except BaseException:
        for name in names.values():
            print(f"--- {name} ---\n{podman('logs', name, check=False)[-2500:]}", file=sys.stderr)
        raise
    finally:
        podman("rm", "-f", *names.values(), check=False)
        podman("network", "rm", "-f", network, check=False)


if __name__ == "__main__":
    sys.exit(main())
