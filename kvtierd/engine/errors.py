"""User-facing request errors; the server maps each to one HTTP status."""


class RequestError(ValueError):
    """A request that can never be served as given (a 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests (a 503)."""
