"""The errors a request can end with: one the API found (APIError, answered as JSON in one
shape for every route's 4xx and 5xx) and one from the engine's side (EngineError)."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered as JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    @property
    def type(self) -> str:
        return {400: "invalid_request_error", 404: "not_found_error"}.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


class EngineError(Exception):
    """The engine cannot serve the request; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


class RequestRejected(EngineError):
    def __init__(self, message: str):
        super().__init__(message, status=400)
