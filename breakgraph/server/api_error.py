"""The error the API answers with, as JSON: every route's 4xx and 5xx have its one shape."""

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
