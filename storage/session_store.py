"""The chat-session store: sessions and their messages in SQL (SQLite file or PostgreSQL).

Synchronous and thread-safe: the server calls it from a thread pool. Every call
opens its own ORM session on a shared, pooled engine and returns frozen records,
never ORM rows. A turn (user message + reply) is written in one transaction.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal
from uuid import uuid4

import sqlalchemy as sa
from alembic.util import CommandError
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Engine
from sqlalchemy.orm import sessionmaker

from kvtierd.storage.sql_migrate import upgrade_to_head
from kvtierd.storage.sql_models import MESSAGE_ROLES, MessageRow, PinRow, SessionChunkRow, SessionRow
from kvtierd.storage.store_errors import (
    SessionExistsError,
    SessionNotFoundError,
    SessionStoreError,
    StoreArgumentError,
    StoreUnavailableError,
)

TurnStatus = Literal["complete", "interrupted"]  # what a turn is stored as; "superseded" comes later, by an edit


@dataclass(frozen=True, slots=True)
class SessionRecord:
    id: str
    tenant: str
    qos_class: str
    title: str | None
    system_prompt: str | None
    created_at: datetime  # timezone-aware UTC
    last_used_at: datetime  # timezone-aware UTC
    token_count: int
    pinned: bool


@dataclass(frozen=True, slots=True)
class MessageRecord:
    id: int
    session_id: str
    seq: int  # order within the session, from 0
    role: str  # "user" or "assistant"
    content: str
    status: str  # "complete" or "interrupted"
    created_at: datetime  # timezone-aware UTC
    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass(frozen=True, slots=True)
class PinRecord:
    id: str
    tenant: str
    kind: str  # "prefix" or "session"
    session_id: str | None
    token_ids: tuple[int, ...]  # a prefix pin's tokens
    created_at: datetime  # timezone-aware UTC
    expires_at: datetime | None  # timezone-aware UTC; None: until unpinned
    tier: str = "device"  # where it holds its KV: "device", "host" or "disk"


class SessionStore:
    """Sessions and messages of every tenant; each call sees only the given tenant's rows."""

    def __init__(self, url: str, *, timeout_s: int = 5) -> None:
        """Open the database at `url` and migrate it to the newest schema.

        `timeout_s` bounds how long a call waits to connect (PostgreSQL) or for
        another writer's lock (both), so an unreachable database fails fast.
        """
        self._url = _parse_url(url)
        self._engine = _make_engine(self._url, timeout_s)
        try:
            with self._db_errors(), self._engine.begin() as conn:
                upgrade_to_head(url, connection=conn)
        except BaseException:
            self._engine.dispose()
            raise
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_session(
        self,
        tenant: str,
        *,
        session_id: str | None = None,
        system_prompt: str | None = None,
        title: str | None = None,
        qos_class: str = "normal",
    ) -> SessionRecord:
        """A new session, with `session_id` when the client chose one (SessionExistsError when the tenant has
        it already) or a fresh random id."""
        if not tenant:
            raise StoreArgumentError("tenant must be a non-empty string")
        if session_id is not None and not session_id:
            raise StoreArgumentError("a session id must be a non-empty string")
        now = _utcnow()
        row = SessionRow(
            id=session_id or f"sess_{uuid4().hex}",
            tenant=tenant,
            qos_class=qos_class,
            title=title,
            system_prompt=system_prompt,
            created_at=now,
            last_used_at=now,
            token_count=0,
            pinned=False,
        )
        with self._db_errors(), self._sessions.begin() as db:
            db.add(row)
            try:
                db.flush()
            except sa_exc.IntegrityError:  # the primary key: the tenant has this id
                raise SessionExistsError(row.id) from None
            return _session_record(row)

    def get_or_create_session(self, tenant: str, session_id: str, *, system_prompt: str | None = None,
                              qos_class: str = "normal") -> tuple[SessionRecord, bool]:
        """The tenant's session `session_id`, created first when it has none; True when it was created here.

        Two first requests racing on one id both get the one session: the loser of the insert reads it."""
        found = self.get_session(tenant, session_id)
        if found is not None:
            return found, False
        try:
            return self.create_session(tenant, session_id=session_id, system_prompt=system_prompt,
                                       qos_class=qos_class), True
        except SessionExistsError:
            found = self.get_session(tenant, session_id)
            if found is None:  # created and deleted between our two calls
                raise SessionNotFoundError(session_id) from None
            return found, False

    def list_sessions(self, tenant: str, limit: int = 100) -> list[SessionRecord]:
        """This tenant's sessions, most recently used first."""
        if limit < 1:
            raise StoreArgumentError(f"limit must be at least 1, got {limit}")
        query = (
            sa.select(SessionRow)
            .where(SessionRow.tenant == tenant)
            .order_by(SessionRow.last_used_at.desc(), SessionRow.id)
            .limit(limit)
        )
        with self._db_errors(), self._sessions.begin() as db:
            return [_session_record(row) for row in db.scalars(query)]

    def list_all_sessions(self, limit: int = 100) -> list[SessionRecord]:
        """Every tenant's sessions, most recently used first: for administrators only."""
        if limit < 1:
            raise StoreArgumentError(f"limit must be at least 1, got {limit}")
        query = (sa.select(SessionRow).order_by(SessionRow.last_used_at.desc(), SessionRow.tenant, SessionRow.id)
                 .limit(limit))
        with self._db_errors(), self._sessions.begin() as db:
            return [_session_record(row) for row in db.scalars(query)]

    def tenants_of(self, session_id: str) -> list[str]:
        """The tenants that have a session with this id, sorted (for administrators, who then use the tenant's
        calls; frontends choose ids, so two tenants may share one)."""
        query = sa.select(SessionRow.tenant).where(SessionRow.id == session_id).order_by(SessionRow.tenant)
        with self._db_errors(), self._sessions.begin() as db:
            return list(db.scalars(query))

    def count_messages(self, sessions: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """How many messages each (tenant, session id) has."""
        query = (
            sa.select(MessageRow.tenant, MessageRow.session_id, sa.func.count())
            .where(sa.tuple_(MessageRow.tenant, MessageRow.session_id).in_(list(sessions)))
            .group_by(MessageRow.tenant, MessageRow.session_id)
        )
        with self._db_errors(), self._sessions.begin() as db:
            counts = {(tenant, sid): n for tenant, sid, n in db.execute(query)} if sessions else {}
        return {key: counts.get(key, 0) for key in sessions}

    def get_session(self, tenant: str, session_id: str) -> SessionRecord | None:
        """The session, or None when it does not exist or belongs to another tenant."""
        with self._db_errors(), self._sessions.begin() as db:
            row = db.scalar(sa.select(SessionRow).where(_owned(session_id, tenant)))
            return None if row is None else _session_record(row)

    def messages(self, tenant: str, session_id: str) -> list[MessageRecord]:
        """The session's messages in order; raises SessionNotFoundError for another tenant's session."""
        query = (sa.select(MessageRow).where(MessageRow.tenant == tenant, MessageRow.session_id == session_id)
                 .order_by(MessageRow.seq))
        with self._db_errors(), self._sessions.begin() as db:
            if db.scalar(sa.select(SessionRow.id).where(_owned(session_id, tenant))) is None:
                raise SessionNotFoundError(session_id)
            return [_message_record(row) for row in db.scalars(query)]

    def append_turn(
        self,
        tenant: str,
        session_id: str,
        user_content: str,
        assistant_content: str,
        *,
        status: TurnStatus = "complete",
        prompt_tokens: int | None,
        completion_tokens: int | None,
        token_count: int,
        supersede_from: int | None = None,
        earlier: Sequence[tuple[str, str]] = (),
        chunk_store: str = "",
        chunk_keys: Sequence[bytes] = (),
    ) -> tuple[MessageRecord, MessageRecord]:
        """Store a user message and its reply together, or neither.

        Both messages carry the turn's `status`: "complete", or "interrupted" when
        the reply was cut short (client gone, cancelled, error). The usage counts
        belong to the reply; `token_count` is the session's new total.

        An edited history: messages from seq `supersede_from` on are marked
        "superseded" (kept, not deleted), and `earlier` (role, content) messages
        the edit brought are stored, complete, before the user message.

        `chunk_keys`: the disk-tier chunks (in `chunk_store`) that hold the session's KV after this
        turn, its whole chain: they replace the session's rows for that store in the same transaction
        (an earlier turn's partial chunk, or a chain an edit left behind, is no longer named).
        """
        if status not in ("complete", "interrupted"):
            raise StoreArgumentError(f"a turn's status is complete or interrupted, not {status!r}")
        if any(role not in MESSAGE_ROLES for role, _ in earlier):
            raise StoreArgumentError(f"messages' roles are {MESSAGE_ROLES}")
        now = _utcnow()
        touch = (
            sa.update(SessionRow)
            .where(_owned(session_id, tenant))
            .values(last_used_at=now, token_count=token_count)
        )
        mine = (MessageRow.tenant == tenant, MessageRow.session_id == session_id)
        last_seq = sa.select(sa.func.max(MessageRow.seq)).where(*mine)
        with self._db_errors(), self._sessions.begin() as db:
            # Write the session row before reading max(seq): that takes its lock
            # (a row lock in PostgreSQL, the write lock in SQLite) first, so
            # concurrent turns on one session queue up instead of racing for a seq.
            if db.connection().execute(touch).rowcount != 1:
                raise SessionNotFoundError(session_id)
            if supersede_from is not None:
                db.execute(sa.update(MessageRow)
                           .where(*mine, MessageRow.seq >= supersede_from)
                           .values(status="superseded"))
            last = db.scalar(last_seq)
            seq = 0 if last is None else last + 1
            for role, content in earlier:
                db.add(MessageRow(tenant=tenant, session_id=session_id, seq=seq, role=role, content=content, status="complete",
                                  created_at=now))
                seq += 1
            user = MessageRow(
                tenant=tenant,
                session_id=session_id,
                seq=seq,
                role="user",
                content=user_content,
                status=status,
                created_at=now,
            )
            reply = MessageRow(
                tenant=tenant,
                session_id=session_id,
                seq=seq + 1,
                role="assistant",
                content=assistant_content,
                status=status,
                created_at=now,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
            )
            db.add_all([user, reply])
            if chunk_keys:
                ours = (SessionChunkRow.tenant == tenant, SessionChunkRow.session_id == session_id,
                        SessionChunkRow.store == chunk_store)
                known = set(db.scalars(sa.select(SessionChunkRow.chunk_key).where(*ours)))
                if stale := known.difference(chunk_keys):
                    db.execute(sa.delete(SessionChunkRow).where(*ours, SessionChunkRow.chunk_key.in_(stale)))
                db.add_all([SessionChunkRow(tenant=tenant, session_id=session_id, store=chunk_store, chunk_key=key,
                                            created_at=now)
                            for key in dict.fromkeys(chunk_keys) if key not in known])
            db.flush()
            return _message_record(user), _message_record(reply)

    def delete_session(self, tenant: str, session_id: str) -> bool:
        """Delete the session and (by ON DELETE CASCADE) its messages; False if there was none."""
        query = sa.delete(SessionRow).where(_owned(session_id, tenant))
        with self._db_errors(), self._sessions.begin() as db:
            return db.connection().execute(query).rowcount == 1

    # -- the chunk catalog ---------------------------------------------------------

    def cataloged_chunks(self, chunk_store: str) -> set[bytes]:
        """The keys of the chunks in `chunk_store` that some session's rows name."""
        query = sa.select(SessionChunkRow.chunk_key).where(SessionChunkRow.store == chunk_store).distinct()
        with self._db_errors(), self._sessions.begin() as db:
            return set(db.scalars(query))

    def recent_session_chunks(self, chunk_store: str, num_sessions: int) -> list[bytes]:
        """The cataloged chunks in `chunk_store` of the `num_sessions` most recently used sessions that have
        some, least recent session first, each session's in the order its turns stored them."""
        cataloged = sa.select(SessionChunkRow.tenant, SessionChunkRow.session_id).where(
            SessionChunkRow.store == chunk_store)
        recent = (sa.select(SessionRow.tenant, SessionRow.id, SessionRow.last_used_at)
                  .where(sa.tuple_(SessionRow.tenant, SessionRow.id).in_(cataloged))
                  .order_by(SessionRow.last_used_at.desc(), SessionRow.tenant, SessionRow.id).limit(num_sessions)
                  .subquery())
        query = (sa.select(SessionChunkRow.chunk_key)
                 .join(recent, sa.and_(recent.c.tenant == SessionChunkRow.tenant,
                                       recent.c.id == SessionChunkRow.session_id))
                 .where(SessionChunkRow.store == chunk_store)
                 .order_by(recent.c.last_used_at, recent.c.tenant, recent.c.id, SessionChunkRow.created_at,
                           SessionChunkRow.chunk_key))
        with self._db_errors(), self._sessions.begin() as db:
            keys = list(db.scalars(query))
        return list(reversed(dict.fromkeys(reversed(keys))))  # a shared chunk where its latest session has it

    def uncatalog_chunks(self, chunk_store: str, chunk_keys: Sequence[bytes]) -> int:
        """Deletes every session's rows for these chunks of `chunk_store`; returns how many rows went."""
        removed = 0
        with self._db_errors(), self._sessions.begin() as db:
            for i in range(0, len(chunk_keys), 500):  # bounded IN lists
                removed += db.execute(sa.delete(SessionChunkRow).where(
                    SessionChunkRow.store == chunk_store,
                    SessionChunkRow.chunk_key.in_(chunk_keys[i : i + 500]))).rowcount
        return removed

    # -- pins ----------------------------------------------------------------------

    def save_pin(self, pin: PinRecord) -> None:
        """Adds or replaces a pin."""
        row = PinRow(id=pin.id, tenant=pin.tenant, kind=pin.kind, session_id=pin.session_id,
                     token_ids=",".join(map(str, pin.token_ids)) or None, tier=pin.tier,
                     created_at=pin.created_at, expires_at=pin.expires_at)
        with self._db_errors(), self._sessions.begin() as db:
            db.merge(row)

    def delete_pin(self, pin_id: str) -> bool:
        with self._db_errors(), self._sessions.begin() as db:
            return db.execute(sa.delete(PinRow).where(PinRow.id == pin_id)).rowcount > 0

    def list_pins(self) -> list[PinRecord]:
        """Every pin, oldest first; those past their expiry are deleted instead."""
        now = _utcnow()
        with self._db_errors(), self._sessions.begin() as db:
            db.execute(sa.delete(PinRow).where(PinRow.expires_at <= now))
            rows = db.scalars(sa.select(PinRow).order_by(PinRow.created_at, PinRow.id))
            return [PinRecord(r.id, r.tenant, r.kind, r.session_id,
                              tuple(int(t) for t in r.token_ids.split(",")) if r.token_ids else (),
                              r.created_at, r.expires_at, r.tier) for r in rows]

    @contextmanager
    def _db_errors(self) -> Iterator[None]:
        """Turn SQLAlchemy and alembic errors into the store's own, naming the database without its password."""
        where = self._url.render_as_string(hide_password=True)
        try:
            yield
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError) as e:
            # Refused, timed out, dropped, or locked past the timeout: all worth a retry later.
            raise StoreUnavailableError(f"session database {where} unavailable: {_reason(e)}") from e
        except sa_exc.DBAPIError as e:
            if e.connection_invalidated:
                raise StoreUnavailableError(f"session database {where} unavailable: {_reason(e)}") from e
            raise SessionStoreError(f"session database {where} rejected a write: {_reason(e)}") from e
        except sa_exc.SQLAlchemyError as e:
            raise SessionStoreError(f"session database {where}: {e}") from e
        except CommandError as e:
            # e.g. a database migrated by a newer kvtierd than this one.
            raise SessionStoreError(f"cannot migrate session database {where}: {e}") from e


def _owned(session_id: str, tenant: str) -> sa.ColumnElement[bool]:
    """The one tenant check: a session is addressed by its id and its owner together."""
    return sa.and_(SessionRow.id == session_id, SessionRow.tenant == tenant)


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _reason(e: sa_exc.DBAPIError | sa_exc.SQLAlchemyError) -> str:
    orig = getattr(e, "orig", None)
    return str(orig if orig is not None else e).strip()


def _parse_url(url: str) -> URL:
    try:
        return sa.make_url(url)
    except sa_exc.ArgumentError as e:
        raise StoreArgumentError(f"not a database URL: {url!r} (e.g. sqlite:////var/lib/kvtierd/sessions.db)") from e


def _make_engine(url: URL, timeout_s: int) -> Engine:
    try:
        if url.get_backend_name() == "sqlite":
            return _sqlite_engine(url, timeout_s)
        connect_args: dict[str, Any] = {}
        if url.get_backend_name() == "postgresql":
            # connect_timeout: fail fast on an unreachable server instead of hanging a worker;
            # lock_timeout: the same bound on waiting for another writer as SQLite's busy_timeout.
            connect_args = {"connect_timeout": timeout_s, "options": f"-c lock_timeout={timeout_s * 1000}"}
        # pre_ping: a pooled connection to a restarted server is replaced, not handed out broken.
        return sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ImportError) as e:
        raise StoreArgumentError(f"cannot use database URL {url.render_as_string(hide_password=True)}: {e}") from e


def _sqlite_engine(url: URL, timeout_s: int) -> Engine:
    path = url.database
    if path and path != ":memory:" and not path.startswith("file:"):
        Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, connect_args={"timeout": timeout_s})

    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")  # off by default; ON DELETE CASCADE needs it
        cursor.execute("PRAGMA journal_mode=WAL")  # readers no longer block the writer
        cursor.execute(f"PRAGMA busy_timeout={timeout_s * 1000}")  # wait for the write lock, then fail
        cursor.close()

    return engine


def _session_record(row: SessionRow) -> SessionRecord:
    return SessionRecord(
        id=row.id,
        tenant=row.tenant,
        qos_class=row.qos_class,
        title=row.title,
        system_prompt=row.system_prompt,
        created_at=row.created_at,
        last_used_at=row.last_used_at,
        token_count=row.token_count,
        pinned=row.pinned,
    )


def _message_record(row: MessageRow) -> MessageRecord:
    return MessageRecord(
        id=row.id,
        session_id=row.session_id,
        seq=row.seq,
        role=row.role,
        content=row.content,
        status=row.status,
        created_at=row.created_at,
        prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens,
    )
