"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `ApiError`; the middleware in app.py turns it, aiohttp's own
HTTP errors and engine `RequestError`s into this shape, each with one status.
"""

from __future__ import annotations

from aiohttp import web


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(message: str, code: str = "not_found") -> ApiError:
    return ApiError(404, message, code=code)


def forbidden(message: str) -> ApiError:
    return ApiError(403, message, type="permission_error", code="forbidden")


def unavailable(message: str, retry_after_s: int = 5) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code="unavailable",
                    headers={"Retry-After": str(retry_after_s)})
