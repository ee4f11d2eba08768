"""The router's FastAPI app with a short way in for its hot routes: a POST to one of them skips FastAPI's middleware
stack, routing and endpoint wrapping (about a quarter of a small completion's time in the router, by py-spy) and
goes straight to its handler; its errors go to the app's own exception handlers, as they would through FastAPI.
Every other request, and the OpenAPI document (the hot routes stay declared), is FastAPI's."""

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

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
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception as error:  # noqa: BLE001 - answered by the handler registered for its type
            response = await self._handler_for(error)(request, error)
        await response(scope, receive, send)

    def _handler_for(self, error: Exception) -> Callable[[Request, Exception], Awaitable[Response]]:
        for cls in type(error).__mro__:  # the most specific registered type, as Starlette looks it up
            if cls in self.exception_handlers:
                return self.exception_handlers[cls]
        raise error
