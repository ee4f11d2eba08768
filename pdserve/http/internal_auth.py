"""The credential every internal HTTP call carries (router -> worker, decode -> prefill): one shared secret per
deployment, sent as a bearer token and checked by the worker in constant time before any route runs.

Where the secret comes from is decided once, at the command line's edge (`internal_token_from`): the chart hands it
to every pod from a Kubernetes Secret and `pdserve up` makes one for its processes, both through the environment
(never on a command line, where `ps` would show it); a process started by hand with neither shares a per-user
file that the first one creates, so a router and workers started on one machine agree with no flag."""

import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"
# Probes and Prometheus carry no credential: liveness/readiness and metrics reveal load figures, never KV or prompts.
OPEN_PATHS = frozenset({"/health", "/metrics"})
_UNAUTHORIZED = json.dumps({"error": {
    "message": "internal API: missing or wrong credential", "type": "invalid_request_error", "code": "unauthorized",
}}).encode()


def bearer_headers(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def default_token_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "pdserve" / "internal-token"


def internal_token_from(token_file: str | None, environ: Mapping[str, str]) -> str:
    """The deployment's secret: `token_file` if given, else $PDSERVE_INTERNAL_TOKEN, else the per-user default file
    (created with a fresh random token, readable by its owner only, when missing)."""
    if token_file:
        return _read_token(Path(token_file))
    if environ.get(TOKEN_ENV):
        return environ[TOKEN_ENV]
    path = default_token_file()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first: use theirs
            return _read_token(path)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_urlsafe(32) + "\n")
        log.warning("no internal credential given: made %s (processes of this user on this machine share it)", path)
    return _read_token(path)


def _read_token(path: Path) -> str:
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"internal credential file {path} is empty")
    return token


class InternalAuth:
    """ASGI middleware: every HTTP request outside `open_paths` needs `Authorization: Bearer <token>`; else 401."""

    def __init__(self, app: ASGIApp, token: str, open_paths: Iterable[str] = OPEN_PATHS) -> None:
        if not token:
            raise ValueError("the internal API needs a non-empty credential")
        self.app = app
        self._digest = hashlib.sha256(f"Bearer {token}".encode()).digest()
        self._open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
            (b"content-length", str(len(_UNAUTHORIZED)).encode())]})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})

    def _authorized(self, scope: Scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        # Digests compared, so neither the length nor the bytes of the secret leak through timing.
        return hmac.compare_digest(hashlib.sha256(given).digest(), self._digest)
