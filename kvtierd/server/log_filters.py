"""Logging filters for the daemon's logs.

aiohttp logs a malformed request (bad bytes, too many headers) with a full
traceback at ERROR level, though it answers it with a 400 and nothing is wrong
with the daemon: one hostile client could fill the journal with tracebacks.
Such a record becomes one WARNING line naming the client's error.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError


class ClientErrorFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError) and 400 <= error.code < 500:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = "malformed request refused with %d: %s", (error.code, error.message)
            record.exc_info = record.exc_text = None
        return True


def quiet_client_errors() -> None:
    logging.getLogger("aiohttp.server").addFilter(ClientErrorFilter())
