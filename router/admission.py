"""Who may send a request and how many at once: API keys (constant-time compare), a bound on requests in flight
and on concurrent requests per key (429 with Retry-After rather than an unbounded wait), and the body size."""

import hashlib
import hmac
from collections.abc import Callable

from starlette.requests import Request

from pdserve_router.errors import APIError


def authenticate(authorization: str | None, api_keys: frozenset[str]) -> str:
    """The caller's key ('' when keys are off); 401 when keys are on and none of them matches."""
    if not api_keys:
        return ""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise APIError(401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
    # Compare against every key, always, so the time taken says nothing about which key (or prefix) was close;
    # compare digests, not the keys, because compare_digest returns early on a length mismatch (leaking key lengths).
    token_digest = hashlib.sha256(token.encode()).digest()
    matched = False
    for key in api_keys:
        matched |= hmac.compare_digest(token_digest, hashlib.sha256(key.encode()).digest())
    if not matched:
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")
    return token


class Admission:
    def __init__(self, max_in_flight: int, max_per_key: int, retry_after_s: int) -> None:
        self._max_in_flight = max_in_flight
        self._max_per_key = max_per_key
        self._retry_after_s = retry_after_s
        self.in_flight = 0
        self._per_key: dict[str, int] = {}

    def enter(self, api_key: str) -> Callable[[], None]:
        """Admit one request or raise 429; returns the function that releases it (safe to call twice)."""
        headers = {"Retry-After": str(self._retry_after_s)}
        if self.in_flight >= self._max_in_flight:
            raise APIError(429, "the router is at its request limit; retry later", code="rate_limit_exceeded",
                           type="rate_limit_error", headers=headers)
        if api_key and self._per_key.get(api_key, 0) >= self._max_per_key:
            raise APIError(429, "too many concurrent requests for this API key", code="rate_limit_exceeded",
                           type="rate_limit_error", headers=headers)
        self.in_flight += 1
        self._per_key[api_key] = self._per_key.get(api_key, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.in_flight -= 1
            self._per_key[api_key] -= 1
            if not self._per_key[api_key]:
                del self._per_key[api_key]

        return release


async def read_body_limited(request: Request, max_bytes: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed `max_bytes` (without reading the rest)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large")
