"""User-facing request errors; the server maps each to one HTTP status."""


class RequestError(ValueError):
    """A request that can never be served as given (a 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class OverloadedError(RuntimeError):
    """A request refused unserved, past its class's max_queue_s or shed (a 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests (a 503)."""
