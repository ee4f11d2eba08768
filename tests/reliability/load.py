"""A bounded closed-loop load generator for soak tests: N concurrent clients issuing mixed completions (streamed and
not, text and token-id prompts, short and long) through a router until a deadline; every request is checked and
bounded by a timeout, and per-process resident memory is sampled."""

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx


class LostRequest(Exception):
    """A response that looked successful but was not: a stream cut with neither `[DONE]` nor an error event, or
    other than the tokens asked for (requests use ignore_eos)."""


# Retrying at once against a router that is down would spin; real clients back off too.
BACKOFF_AFTER_CUT_S = 0.25


@dataclass
class LoadReport:
    completed: int = 0
    errors: list[str] = field(default_factory=list)  # clear failures: an HTTP error status or an error event
    cut: list[str] = field(default_factory=list)  # the connection was refused or broken (the router went away)
    lost: list[str] = field(default_factory=list)  # silent failures (LostRequest); must stay empty
    hung: int = 0  # requests that hit the per-request timeout
    tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    finished: list[tuple[float, int]] = field(default_factory=list)  # (time.monotonic() at the end, tokens)

    def tokens_between(self, start_s: float, end_s: float) -> int:
        return sum(tokens for at_s, tokens in self.finished if start_s <= at_s < end_s)

    def percentile_s(self, fraction: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


def rss_bytes(pid: int) -> int:
    """Resident set size from /proc (Linux)."""
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_actor_pids_of(worker_pid: int) -> list[int]:
    """The live rank actors of one worker process joined to a shared Ray (they are not its children there). Each
    worker is its own Ray job (its driver), so its actors are those of the job whose driver has its pid. Read from
    the GCS tables through a private module: ray.util.state needs the dashboard, which pdserve does not start."""
    from ray._private import state

    jobs = {job["JobID"] for job in state.jobs() if job["DriverPid"] == worker_pid and not job["IsDead"]}
    return sorted(actor["Pid"] for actor in state.actors().values()
                  if actor["JobID"] in jobs and actor["ActorClassName"] == "RankActor" and actor["State"] == "ALIVE")


async def _one(http: httpx.AsyncClient, url: str, model: str, rng: random.Random, report: LoadReport,
               request_timeout_s: float) -> None:
    max_tokens = rng.choice([1, 4, 16, 64, 160])
    prompt = (list(rng.randrange(2, 500) for _ in range(rng.choice([3, 20, 90, 300])))
              if rng.random() < 0.5 else "soak " * rng.randrange(1, 60))
    stream = rng.random() < 0.7
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]),
            "ignore_eos": True, "stream": stream, "return_token_ids": True}
    started = time.monotonic()

    async def call() -> int:
        if not stream:
            response = await http.post(url + "/v1/completions", json=body)
            if response.status_code != 200:
                raise AssertionError(f"HTTP {response.status_code}: {response.text[:200]}")
            return len(response.json()["choices"][0]["token_ids"])
        tokens, done, finish = 0, False, None
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise AssertionError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise AssertionError(f"error event: {chunk['error']}")
                    for choice in chunk["choices"]:
                        tokens += len(choice.get("token_ids") or [])
                        finish = choice.get("finish_reason") or finish
        if not done or finish != "length":
            raise LostRequest(f"stream ended without [DONE] or finish (done={done}, finish={finish})")
        return tokens

    try:
        tokens = await asyncio.wait_for(call(), request_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):  # httpx's own read timeout is the same wait
        report.hung += 1
        return
    except LostRequest as error:
        report.lost.append(str(error)[:300])
        return
    except httpx.TransportError as error:
        report.cut.append(repr(error)[:300])
        await asyncio.sleep(BACKOFF_AFTER_CUT_S)
        return
    except (AssertionError, httpx.HTTPError, ValueError) as error:
        report.errors.append(repr(error)[:300])
        return
    if tokens != max_tokens:
        report.lost.append(f"got {tokens} tokens, asked for {max_tokens}")
        return
    report.completed += 1
    report.tokens += tokens
    finished_s = time.monotonic()
    report.latencies_s.append(finished_s - started)
    report.finished.append((finished_s, tokens))


async def run_load(url: str, model: str, concurrency: int, duration_s: float, request_timeout_s: float,
                   seed: int = 0, stop: asyncio.Event | None = None) -> LoadReport:
    """`concurrency` clients, each issuing requests back to back until `duration_s` is over or `stop` is set."""
    report = LoadReport()
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=request_timeout_s, limits=limits) as http:
        async def client(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline and not (stop and stop.is_set()):
                await _one(http, url, model, rng, report, request_timeout_s)

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return report
