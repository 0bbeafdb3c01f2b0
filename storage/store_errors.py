"""Errors the chat-session store raises; SQLAlchemy's own never cross its API."""

from __future__ import annotations


class SessionStoreError(Exception):
    """The store failed in a way the caller cannot fix by retrying with other input."""


class SessionNotFoundError(SessionStoreError, LookupError):
    """No such session for this tenant (another tenant's session is reported the same way)."""


class StoreUnavailableError(SessionStoreError):
    """The database cannot be reached or is locked; retrying later may succeed."""


class StoreArgumentError(SessionStoreError, ValueError):
    """An argument the store does not accept: an unknown status, a bad limit, a malformed URL."""
