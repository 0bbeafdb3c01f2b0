"""A small HTTP client for kvtierd's admin routes, spoken over the daemon's Unix socket.

Every way a call can fail ends as one `AdminError` with a one-line message and an exit
code, so the CLI prints a single line and never a traceback:

    exit 2  no usable answer: socket missing, nothing listening, permission denied,
            timeout, the connection dropped, or an answer that is not kvtierd's JSON
    exit 1  kvtierd answered with an error status (4xx/5xx), e.g. 403 for admin routes

`default_socket_path()` (kvtierd.server.paths) decides the default socket location for
both `kvtierd serve` and `kvtierctl`, so they agree without configuration.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from kvtierd.server.paths import default_socket_path

SOCKET_ENV = "KVTIERD_SOCKET"
# The Host header the daemon sees; over a Unix socket the name only has to be valid.
BASE_URL = "http://kvtierd"

EXIT_DAEMON_ERROR = 1
EXIT_CONNECTION = 2


def resolve_socket_path(explicit: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None) -> Path:
    """`--socket` if given, else `$KVTIERD_SOCKET`, else `default_socket_path()`."""
    env = os.environ if environ is None else environ
    if explicit:
        return Path(explicit)
    if env.get(SOCKET_ENV):
        return Path(env[SOCKET_ENV])
    return default_socket_path(env)


class AdminError(Exception):
    """A failed admin call, already worded for the user (one line, no traceback)."""

    exit_code = EXIT_CONNECTION

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(message))

    @property
    def message(self) -> str:
        return str(self.args[0])


class ConnectionProblem(AdminError):
    """kvtierd could not be reached, or what answered did not speak its protocol."""

    exit_code = EXIT_CONNECTION


class DaemonError(AdminError):
    """kvtierd answered with an error status and (usually) an OpenAI-shaped error body."""

    exit_code = EXIT_DAEMON_ERROR

    def __init__(self, message: str, status: int, type: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.code = code


def connection_error(exc: BaseException, socket_path: Path) -> ConnectionProblem:
    """Word a failure to reach the socket, from the OS error underneath httpx's wrapper."""
    if isinstance(exc, httpx.TimeoutException):
        return ConnectionProblem(f"kvtierd at {socket_path} did not answer in time ({exc or 'timeout'})")
    os_error = _find_os_error(exc)
    if os_error is None:
        return ConnectionProblem(f"cannot talk to kvtierd at {socket_path}: {exc or type(exc).__name__}")
    code = os_error.errno
    if code in (errno.ENOENT, errno.ENOTDIR):
        return ConnectionProblem(
            f"no kvtierd socket at {socket_path} (is the daemon running? set --socket or {SOCKET_ENV})"
        )
    if code == errno.ECONNREFUSED:
        return ConnectionProblem(
            f"nothing is listening on {socket_path} (a stale socket file? is the daemon running?)"
        )
    if code in (errno.EACCES, errno.EPERM):
        return ConnectionProblem(f"permission denied on {socket_path} (join the socket's group or use sudo)")
    reason = os_error.strerror or str(os_error)
    return ConnectionProblem(f"cannot connect to kvtierd at {socket_path}: {reason}")


def decode_response(response: httpx.Response, socket_path: Path) -> dict[str, Any]:
    """The JSON object of a successful answer; otherwise raise the matching `AdminError`."""
    what = f"{response.request.method} {response.request.url.path}"
    try:
        data = response.json()
    except ValueError:  # json.JSONDecodeError and UnicodeDecodeError are both ValueErrors
        data = None
    if response.status_code >= 400:
        raise _daemon_error(response, data)
    if not isinstance(data, dict):
        kind = "not JSON" if data is None else f"JSON {type(data).__name__}, not an object"
        content_type = response.headers.get("content-type", "no content type")
        raise ConnectionProblem(
            f"the answer to {what} from {socket_path} is {kind} (HTTP {response.status_code}, {content_type});"
            " is something other than kvtierd listening there?"
        )
    return data


class AdminClient:
    """`with AdminClient(path) as c: c.get("/admin/status")` returns the decoded JSON object."""

    def __init__(self, socket_path: Path, timeout: float = 10.0) -> None:
        self.socket_path = Path(socket_path)
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.socket_path)),
            base_url=BASE_URL,
            timeout=timeout,
        )

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def get(self, path: str, params: Mapping[str, str | int | None] | None = None) -> dict[str, Any]:
        return self.request("GET", path, params)

    def delete(self, path: str) -> dict[str, Any]:
        return self.request("DELETE", path)

    def request(
        self, method: str, path: str, params: Mapping[str, str | int | None] | None = None, body: Any = None
    ) -> dict[str, Any]:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        return decode_response(self._send(method, path, params=query, json=body), self.socket_path)

    def text(self, path: str) -> str:
        """The body of a plain-text answer (e.g. /metrics); errors raise as for JSON routes."""
        response = self._send("GET", path)
        if response.status_code >= 400:
            decode_response(response, self.socket_path)  # raises the daemon's error
        content_type = response.headers.get("content-type", "no content type")
        if not content_type.startswith("text/plain"):
            raise ConnectionProblem(f"the answer to GET {path} from {self.socket_path} is {content_type}, not text;"
                                    " is something other than kvtierd listening there?")
        return response.text

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise connection_error(e, self.socket_path) from e
        except OSError as e:  # raised before httpx wraps it, e.g. a path too long for AF_UNIX
            raise connection_error(e, self.socket_path) from e


def _daemon_error(response: httpx.Response, data: Any) -> DaemonError:
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return DaemonError(str(error["message"]), response.status_code, error.get("type"), error.get("code"))
    if isinstance(error, str) and error:  # tolerate {"error": "..."}
        return DaemonError(error, response.status_code)
    status = f"{response.status_code} {response.reason_phrase}".strip()
    snippet = _one_line(response.text)[:200] if data is None else _one_line(json.dumps(data))[:200]
    return DaemonError(f"kvtierd answered {status}" + (f": {snippet}" if snippet else ""), response.status_code)


def _find_os_error(exc: BaseException | None) -> OSError | None:
    """The first OSError in the exception and its causes (httpx -> httpcore -> OSError)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
