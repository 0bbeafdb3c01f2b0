"""Errors the storage backends raise; SQLAlchemy's and LMDB's own never cross their APIs."""

from __future__ import annotations


class SessionStoreError(Exception):
    """The store failed in a way the caller cannot fix by retrying with other input."""


class SessionNotFoundError(SessionStoreError, LookupError):
    """No such session for this tenant (another tenant's session is reported the same way)."""


class SessionExistsError(SessionStoreError):
    """The tenant already has a session with the id a client chose."""


class StoreUnavailableError(SessionStoreError):
    """A store cannot be used: the session database is down or locked, or a KV tier's
    directory is missing, unwritable or corrupt. Retrying later may succeed.

    The KV stores raise it too (a daemon then runs without that tier); it stays a
    SessionStoreError so the callers that catch the session store's errors keep working.
    """


class StoreArgumentError(SessionStoreError, ValueError):
    """An argument the store does not accept: an unknown status, a bad limit, a malformed URL."""


class CorruptValueError(Exception):
    """A stored KV value failed a check (checksum, geometry, namespace, hashes, token ids).

    Never served: the caller treats it as a miss and quarantines it. `check` names what failed.
    """

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.check = check
