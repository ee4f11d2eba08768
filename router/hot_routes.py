"""The router's FastAPI app with a short way in for its hot routes: a POST to one of them skips FastAPI's middleware
stack, routing and endpoint wrapping (about a quarter of a small completion's time in the router, by py-spy) and
goes straight to its handler; its errors go to the app's own exception handlers, as they would through FastAPI.
Every other request, and the OpenAPI document (the hot routes stay declared), is FastAPI's.

Served by uvicorn, a hot POST takes a shorter way still (`hot_route_http`): the server's protocol hands it to its
handler without the ASGI messages around it, and a response with its whole body goes out in one write. uvicorn keeps
the connection (keep-alive, pipelining, disconnects, draining, the slow-client bounds); a stream goes through its ASGI
send as before. On a 2-core machine it used less of the router's CPU a request than the ASGI way in 9 of 10 pairs at
concurrency 16, by a median 85 us (docs/benchmarks.md, "A front of our own, gated first").
"""

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from pdserve.http.slow_clients import SlowClientBoundedHttpTools, SlowClientLimits

HotHandler = Callable[[Request], Awaitable[Response]]


class RouterApp(FastAPI):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hot_posts: dict[str, HotHandler] = {}  # exact path -> handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.hot_posts.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            return await super().__call__(scope, receive, send)
        scope["app"] = self
        response = await self.answer(handler, Request(scope, receive))
        await response(scope, receive, send)

    async def answer(self, handler: HotHandler, request: Request) -> Response:
        """The hot handler's response, or the one the handler registered for its error's type gives."""
        try:
            return await handler(request)
        except Exception as error:  # noqa: BLE001 - answered by the handler registered for its type
            return await self._handler_for(error)(request, error)

    def _handler_for(self, error: Exception) -> Callable[[Request, Exception], Awaitable[Response]]:
        for cls in type(error).__mro__:  # the most specific registered type, as Starlette looks it up
            if cls in self.exception_handlers:
                return self.exception_handlers[cls]
        raise error


class HotRouteHttpTools(SlowClientBoundedHttpTools):
    """The slow-client-bounded httptools protocol whose hot POSTs run as `_answer_hot` instead of the ASGI app; build
    a subclass with its app and limits through `hot_route_http`."""

    router_app: RouterApp

    def _start_asgi_task(self, cycle: RequestResponseCycle, app) -> None:
        scope = cycle.scope
        # `app` is not the server's own where uvicorn answers for itself (past its concurrency limit)
        hot = scope["method"] == "POST" and app is self.app
        handler = self.router_app.hot_posts.get(scope["path"]) if hot else None
        if handler is None:
            return super()._start_asgi_task(cycle, app)

        async def hot_app(scope: Scope, receive: Receive, send: Send) -> None:  # run as uvicorn runs an app
            await self._answer_hot(cycle, handler)
        super()._start_asgi_task(cycle, hot_app)

    async def _answer_hot(self, cycle: RequestResponseCycle, handler: HotHandler) -> None:
        scope = cycle.scope
        scope["app"] = self.router_app
        response = await self.router_app.answer(handler, Request(scope, cycle.receive))
        if type(response).__call__ is not Response.__call__:  # a stream: its own ASGI sends
            await response(scope, cycle.receive, cycle.send)
            return
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if not cycle.disconnected:
            self._write_whole(cycle, response)
        if response.background is not None:
            await response.background()

    def _write_whole(self, cycle: RequestResponseCycle, response: Response) -> None:
        """What cycle.send writes for a response's head and then its whole body, as one write. The headers are the
        app's own (uvicorn's send also checks them for characters that would break the head)."""
        head = [STATUS_LINE[response.status_code]]
        closes = False
        for name, value in (*cycle.default_headers, *response.raw_headers):
            if name == b"connection" and b"close" in value.lower():
                closes = True
            head += (name, b": ", value, b"\r\n")
        if closes:
            cycle.keep_alive = False
        elif not cycle.keep_alive:
            head.append(b"connection: close\r\n")
        head += (b"\r\n", response.body)
        cycle.response_started = cycle.response_complete = True
        cycle.waiting_for_100_continue = False
        self.transport.write(b"".join(head))
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()


def hot_route_http(limits: SlowClientLimits, app: RouterApp) -> type[HotRouteHttpTools]:
    """What to pass as uvicorn's `http=` for the router: the slow-client bounds, and `app`'s hot POSTs the short way."""
    return type("HotRouteHttpTools", (HotRouteHttpTools,), {"limits": limits, "router_app": app})
