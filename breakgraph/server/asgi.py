"""The ASGI app uvicorn serves: the generation routes called straight from the scope, every
other route (and each generation route's other methods) through FastAPI.

FastAPI's stack in front of an endpoint is a dozen awaits deep (its and Starlette's
middlewares, two routers, the route, the request handler), and each request of a
generation route walks it on its way in and its response on the way out, on the API
process's single thread and on the request's TTFT. The generation endpoints take the raw
``Request`` and answer ``Response`` objects, so nothing of FastAPI's (parameter parsing,
dependencies, response models) works for them; they are called here with the same error
answers (the app's exception handlers)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


class HotRoutes:
    """``routes``: (method, path) -> endpoint, answered without FastAPI's stack."""

    def __init__(self, app: FastAPI, routes: dict[tuple[str, str], Endpoint]):
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http":
            endpoint = self.routes.get((scope["method"], scope["path"]))
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        scope["app"] = self.app  # what Starlette sets: request.app (the server's state)
        request = Request(scope, receive)
        try:
            response = await endpoint(request)
        except ClientDisconnect:
            return  # gone while sending its body: nothing was admitted, no one to answer
        except Exception as e:
            response = await self._error(request, e)
        await response(scope, receive, send)

    async def _error(self, request: Request, e: Exception) -> Response:
        """The app's handler for ``e`` (the nearest registered class), as FastAPI answers."""
        handlers = self.app.exception_handlers
        for cls in type(e).__mro__:
            handler = handlers.get(cls)
            if handler is not None:
                return await handler(request, e)
        raise e
