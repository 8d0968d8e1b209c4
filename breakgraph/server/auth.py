"""``--api-key``: bearer authentication in front of every route but the health probes.

With a key set (``--api-key``, else ``BREAKGRAPH_API_KEY``), a request must carry
``Authorization: Bearer KEY``; one without it is answered 401 in the API's one JSON error shape
before its body is read. ``/health`` and ``/health_generate`` stay open, as SGLang leaves every
``/health*`` path open: a load balancer's or an orchestrator's probe carries no key. Every
other route needs it, ``/metrics`` included (SGLang leaves ``/metrics`` open too; Prometheus
sends a bearer token with ``authorization: {credentials: KEY}``). The key is compared in
constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from breakgraph.server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/health_generate"})


class BearerAuth:
    """An ASGI app that answers 401 unless a request to a closed path carries the key."""

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("an empty API key")
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        problem = self._check(scope)
        if problem is None:
            await self.app(scope, receive, send)
            return
        body = APIError(problem, status=401).body()
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _check(self, scope: Scope) -> str | None:
        """None if the request carries the key, else what is wrong (the key is never echoed)."""
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None:
            return "this server needs an API key: send the header 'Authorization: Bearer KEY'"
        scheme, _, token = header.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return "the Authorization header must be 'Bearer KEY'"
        if not hmac.compare_digest(token.strip(), self._key):
            return "the API key is wrong"
        return None
