"""Synchronous helpers for reliability tests: SSE completions through a real router, parsed event by event."""

import json
import threading
import time
from dataclasses import dataclass, field

from probes import HTTP, internal_headers

TIMEOUT_S = 120.0
STREAMING_AFTER_TOKENS = 20


@dataclass
class StreamResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    errors: list[dict] = field(default_factory=list)  # error events in the stream
    status_code: int = 0
    done: bool = False  # saw `data: [DONE]`
    seconds: float = 0.0


def stream_completion(router_url: str, model: str, prompt: str | list[int], max_tokens: int,
                      timeout_s: float = TIMEOUT_S, streaming: threading.Event | None = None, **extra) -> StreamResult:
    """One streamed completion; every read is bounded by `timeout_s` and so is the whole call. `streaming` is set
    once tokens are arriving (STREAMING_AFTER_TOKENS of them)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, **extra}
    result = StreamResult()
    started = time.monotonic()
    with HTTP.stream("POST", router_url + "/v1/completions", json=body, timeout=timeout_s) as response:
        result.status_code = response.status_code
        if response.status_code != 200:
            response.read()
            result.errors.append({"status": response.status_code, "body": response.text[:300]})
            return result
        for line in response.iter_lines():
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"stream still running after {timeout_s} s")
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                result.done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                result.errors.append(chunk["error"])
                continue
            for choice in chunk.get("choices", []):
                result.text += choice.get("text", "")
                result.token_ids.extend(choice.get("token_ids") or [])
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if streaming is not None and len(result.token_ids) >= STREAMING_AFTER_TOKENS:
                streaming.set()
    result.seconds = time.monotonic() - started
    return result


def model_of(router_url: str) -> str:
    return HTTP.get(router_url + "/v1/models", timeout=10).json()["data"][0]["id"]


def worker_load(worker_url: str) -> list[dict]:
    return HTTP.get(worker_url + "/internal/v1/load", headers=internal_headers(), timeout=10).json()["ranks"]


def pages_at_rest(worker_url: str) -> bool:
    return all(r["free_pages"] + r["prefix_cache_pages"] == r["total_pages"] and r["running"] == 0
               and r["waiting"] == 0 for r in worker_load(worker_url))


def running(worker_url: str) -> int:
    return sum(r["running"] + r["waiting"] for r in worker_load(worker_url))


