"""The chat-session store, run against a real SQLite file and a real PostgreSQL 15."""

from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import Engine
from waiting import HANG_GUARD_S

from kvtierd.storage.session_store import SessionStore
from kvtierd.storage.sql_migrate import alembic_config, upgrade_to_head
from kvtierd.storage.sql_models import Base
from kvtierd.storage.store_errors import (
    SessionExistsError,
    SessionNotFoundError,
    SessionStoreError,
    StoreArgumentError,
    StoreUnavailableError,
)

_db_names = itertools.count()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database per test: a SQLite file in a not-yet-existing dir, or a fresh PostgreSQL db."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'sessions.db'}"
    if os.environ.get("KVTIERD_SKIP_POSTGRES") == "1":
        pytest.skip("KVTIERD_SKIP_POSTGRES=1")
    server = request.getfixturevalue("postgres_server")
    url: str = server.create_database(f"sessions_{next(_db_names)}")
    return url


@pytest.fixture
def store(store_url: str) -> Iterator[SessionStore]:
    with SessionStore(store_url) as s:
        yield s


def turn(store: SessionStore, tenant: str, session_id: str, n: int, **kw: Any) -> Any:
    kw.setdefault("prompt_tokens", 10 + n)
    kw.setdefault("completion_tokens", 5)
    kw.setdefault("token_count", 100 + n)
    return store.append_turn(tenant, session_id, f"question {n}", f"answer {n}", **kw)


def count_messages(url: str, session_id: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            query = sa.text("SELECT count(*) FROM messages WHERE session_id = :sid")
            return int(conn.execute(query, {"sid": session_id}).scalar_one())
    finally:
        engine.dispose()


# --- migrations ---------------------------------------------------------------------------


def migrate_to(store_url: str, revision: str) -> None:
    """An empty database at an older schema (its SQLite file's folder made first: only SessionStore makes it)."""
    sqlite_file = sa.make_url(store_url).database
    if store_url.startswith("sqlite") and sqlite_file:
        Path(sqlite_file).parent.mkdir(parents=True)
    command.upgrade(alembic_config(store_url), revision)


def test_migrations_create_the_tables_and_rerunning_is_a_no_op(store_url: str) -> None:
    sqlite_file = sa.make_url(store_url).database
    if store_url.startswith("sqlite") and sqlite_file:
        Path(sqlite_file).parent.mkdir(parents=True)  # only SessionStore creates it
    upgrade_to_head(store_url)
    upgrade_to_head(store_url)

    engine = sa.create_engine(store_url)
    try:
        inspector = sa.inspect(engine)
        assert {"sessions", "messages", "pins", "alembic_version"} <= set(inspector.get_table_names())
        assert {c["name"] for c in inspector.get_columns("sessions")} == {
            "id", "tenant", "qos_class", "title", "system_prompt",
            "created_at", "last_used_at", "token_count", "pinned",
        }  # fmt: skip
        assert {c["name"] for c in inspector.get_columns("messages")} == {
            "id", "tenant", "session_id", "seq", "role", "content", "status",
            "created_at", "prompt_tokens", "completion_tokens",
        }  # fmt: skip
        assert inspector.get_pk_constraint("sessions")["constrained_columns"] == ["tenant", "id"]
        assert [i["column_names"] for i in inspector.get_indexes("sessions")] == [["tenant", "last_used_at"]]
        assert [u["column_names"] for u in inspector.get_unique_constraints("messages")] == [
            ["tenant", "session_id", "seq"]]
        for child in ("messages", "session_chunks"):
            [fk] = inspector.get_foreign_keys(child)
            assert (fk["referred_table"], fk["constrained_columns"], fk["referred_columns"]) == (
                "sessions", ["tenant", "session_id"], ["tenant", "id"])
            assert fk["options"].get("ondelete") == "CASCADE"
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == ["0005"]
            # The models (what the store writes through) say what the migrations made.
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        engine.dispose()

    # A store opened on the migrated database migrates nothing and works.
    with SessionStore(store_url) as store:
        assert store.list_sessions("t") == []


def test_upgrading_a_0004_store_through_the_store_keeps_every_row(store_url: str) -> None:
    """The store migrates on its own connection, where SQLite enforces foreign keys (a careless rebuild of
    `sessions` would cascade-delete every message)."""
    migrate_to(store_url, "0004")
    engine = sa.create_engine(store_url)
    try:
        with engine.begin() as conn:
            for sid, tenant in (("s1", "alice"), ("s2", "bob")):
                conn.execute(sa.text("INSERT INTO sessions (id, tenant, created_at, last_used_at) "
                                     "VALUES (:sid, :tenant, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
                             {"sid": sid, "tenant": tenant})
                conn.execute(sa.text("INSERT INTO messages (session_id, seq, role, content, status, created_at) "
                                     "VALUES (:sid, 0, 'user', :sid, 'complete', CURRENT_TIMESTAMP)"), {"sid": sid})
                conn.execute(sa.text("INSERT INTO session_chunks (session_id, store, chunk_key, created_at) "
                                     "VALUES (:sid, 'host:/s', :key, CURRENT_TIMESTAMP)"),
                             {"sid": sid, "key": sid.encode() * 8})
    finally:
        engine.dispose()
    with SessionStore(store_url) as store:
        assert [m.content for m in store.messages("alice", "s1")] == ["s1"]
        assert [m.content for m in store.messages("bob", "s2")] == ["s2"]
        assert store.cataloged_chunks("host:/s") == {b"s1" * 8, b"s2" * 8}
        bob_s1 = store.create_session("bob", session_id="s1")  # now possible: ids are per tenant
        turn(store, "bob", bob_s1.id, 0)
        assert store.delete_session("alice", "s1")
        assert store.cataloged_chunks("host:/s") == {b"s2" * 8}
        assert len(store.messages("bob", "s1")) == 2


def test_downgrading_to_0004_refuses_ids_two_tenants_share(store_url: str) -> None:
    with SessionStore(store_url) as store:
        store.create_session("alice", session_id="same")
        store.create_session("bob", session_id="other")
    command.downgrade(alembic_config(store_url), "0004")  # every id one tenant's: fine
    upgrade_to_head(store_url)
    with SessionStore(store_url) as store:
        store.create_session("bob", session_id="same")
    with pytest.raises(RuntimeError, match="same"):
        command.downgrade(alembic_config(store_url), "0004")


def test_upgrading_a_0001_store_keeps_its_messages_and_allows_superseded(store_url: str) -> None:
    migrate_to(store_url, "0001")
    engine = sa.create_engine(store_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO sessions (id, tenant, created_at, last_used_at) "
                                 "VALUES ('s1', 't', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
            conn.execute(sa.text("INSERT INTO messages (session_id, seq, role, content, status, created_at) "
                                 "VALUES ('s1', 0, 'user', 'hello', 'complete', CURRENT_TIMESTAMP)"))
        upgrade_to_head(store_url)
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE messages SET status = 'superseded' WHERE session_id = 's1'"))
            assert conn.execute(sa.text("SELECT content, status FROM messages")).all() == [("hello", "superseded")]
            with pytest.raises(sa.exc.IntegrityError):
                conn.execute(sa.text("UPDATE messages SET status = 'lost'"))
    finally:
        engine.dispose()


# --- sessions -----------------------------------------------------------------------------


def test_create_get_list_delete(store: SessionStore) -> None:
    created = store.create_session("acme", system_prompt="Be brief.", title="Plans", qos_class="high")

    assert created.id.startswith("sess_")
    assert (created.tenant, created.qos_class, created.title, created.system_prompt) == (
        "acme", "high", "Plans", "Be brief.",
    )  # fmt: skip
    assert (created.token_count, created.pinned) == (0, False)
    assert created.created_at.tzinfo == UTC
    assert created.last_used_at == created.created_at

    assert store.get_session("acme", created.id) == created
    assert store.list_sessions("acme") == [created]
    assert store.messages("acme", created.id) == []

    assert store.delete_session("acme", created.id) is True
    assert store.get_session("acme", created.id) is None
    assert store.list_sessions("acme") == []
    assert store.delete_session("acme", created.id) is False


def test_defaults(store: SessionStore) -> None:
    created = store.create_session("acme")
    assert (created.qos_class, created.title, created.system_prompt) == ("normal", None, None)


def test_list_is_most_recently_used_first_and_limited(store: SessionStore) -> None:
    first = store.create_session("acme", title="first")
    second = store.create_session("acme", title="second")
    third = store.create_session("acme", title="third")
    assert [s.title for s in store.list_sessions("acme")] == ["third", "second", "first"]

    turn(store, "acme", first.id, 0)
    assert [s.title for s in store.list_sessions("acme")] == ["first", "third", "second"]
    assert [s.title for s in store.list_sessions("acme", limit=2)] == ["first", "third"]
    assert {second.id, third.id} < {s.id for s in store.list_sessions("acme")}
    with pytest.raises(StoreArgumentError):
        store.list_sessions("acme", limit=0)


def test_a_tenant_sees_only_its_own_sessions(store: SessionStore) -> None:
    mine = store.create_session("tenant-a", title="private")
    turn(store, "tenant-a", mine.id, 0)

    assert store.get_session("tenant-b", mine.id) is None
    assert store.list_sessions("tenant-b") == []
    with pytest.raises(SessionNotFoundError):
        store.messages("tenant-b", mine.id)
    with pytest.raises(SessionNotFoundError):
        turn(store, "tenant-b", mine.id, 1)
    assert store.delete_session("tenant-b", mine.id) is False

    # Tenant A's session is untouched by all of that.
    assert [m.content for m in store.messages("tenant-a", mine.id)] == ["question 0", "answer 0"]
    assert store.get_session("tenant-a", mine.id) is not None


def test_a_client_chosen_id_is_its_tenants_alone(store: SessionStore) -> None:
    alice = store.create_session("alice", session_id="chat-42", system_prompt="A")
    assert alice.id == "chat-42"
    with pytest.raises(SessionExistsError):
        store.create_session("alice", session_id="chat-42")
    bob = store.create_session("bob", session_id="chat-42", system_prompt="B")  # another tenant: another session
    assert store.tenants_of("chat-42") == ["alice", "bob"] and store.tenants_of("chat-43") == []

    turn(store, "alice", "chat-42", 0, chunk_store="host:/s", chunk_keys=[b"a" * 16])
    turn(store, "bob", "chat-42", 5, chunk_store="host:/s", chunk_keys=[b"b" * 16])
    turn(store, "bob", "chat-42", 6)
    assert [m.content for m in store.messages("alice", "chat-42")] == ["question 0", "answer 0"]
    assert [m.seq for m in store.messages("bob", "chat-42")] == [0, 1, 2, 3]
    assert store.count_messages([("alice", "chat-42"), ("bob", "chat-42"), ("carol", "chat-42")]) == {
        ("alice", "chat-42"): 2, ("bob", "chat-42"): 4, ("carol", "chat-42"): 0}
    assert {s.system_prompt for s in store.list_all_sessions()} == {"A", "B"}

    assert store.delete_session("alice", "chat-42")
    assert store.get_session("bob", "chat-42").created_at == bob.created_at
    assert len(store.messages("bob", "chat-42")) == 4
    assert store.cataloged_chunks("host:/s") == {b"b" * 16}  # alice's rows went with her session, bob's stay


def test_get_or_create_creates_once(store: SessionStore) -> None:
    created, new = store.get_or_create_session("acme", "conv-1", system_prompt="Be brief.")
    assert new and created.system_prompt == "Be brief." and created.id == "conv-1"
    again, new = store.get_or_create_session("acme", "conv-1", system_prompt="ignored")
    assert not new and again == created


def test_concurrent_first_uses_of_one_id_make_one_session(store: SessionStore) -> None:
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: store.get_or_create_session("acme", "conv-race"), range(16)))
    assert sum(new for _, new in results) == 1
    assert {s for s, _ in results} == {store.get_session("acme", "conv-race")}


def test_unknown_session_is_not_found(store: SessionStore) -> None:
    with pytest.raises(SessionNotFoundError):
        store.messages("acme", "sess_missing")
    with pytest.raises(LookupError):
        turn(store, "acme", "sess_missing", 0)


# --- turns --------------------------------------------------------------------------------


def test_append_turn_stores_the_message_with_its_reply(store: SessionStore) -> None:
    session = store.create_session("acme")

    user, reply = turn(store, "acme", session.id, 0, prompt_tokens=12, completion_tokens=7, token_count=19)
    assert (user.seq, user.role, user.content, user.status) == (0, "user", "question 0", "complete")
    assert (reply.seq, reply.role, reply.content, reply.status) == (1, "assistant", "answer 0", "complete")
    assert (user.prompt_tokens, user.completion_tokens) == (None, None)
    assert (reply.prompt_tokens, reply.completion_tokens) == (12, 7)
    assert reply.created_at.tzinfo == UTC

    turn(store, "acme", session.id, 1, token_count=40)
    messages = store.messages("acme", session.id)
    assert [m.seq for m in messages] == [0, 1, 2, 3]
    assert messages[:2] == [user, reply]

    after = store.get_session("acme", session.id)
    assert after is not None
    assert after.token_count == 40
    assert after.last_used_at > session.last_used_at
    assert after.created_at == session.created_at


def test_an_interrupted_turn_is_marked_interrupted(store: SessionStore) -> None:
    session = store.create_session("acme")
    turn(store, "acme", session.id, 0)
    turn(store, "acme", session.id, 1, status="interrupted", completion_tokens=2)

    statuses = [(m.role, m.status) for m in store.messages("acme", session.id)]
    assert statuses == [
        ("user", "complete"), ("assistant", "complete"),
        ("user", "interrupted"), ("assistant", "interrupted"),
    ]  # fmt: skip


def test_an_edit_supersedes_the_messages_it_replaces_and_stores_what_it_brings(store: SessionStore) -> None:
    session = store.create_session("acme")
    for i in range(3):
        turn(store, "acme", session.id, i)
    # The client edited turn 1's reply and asks a new question: turn 1's reply and turn 2 are replaced.
    store.append_turn("acme", session.id, "new question", "new reply", prompt_tokens=5, completion_tokens=2,
                      token_count=40, supersede_from=3, earlier=[("assistant", "edited reply 1"), ("user", "q2'"),
                                                               ("assistant", "a2'")])
    rows = [(m.seq, m.role, m.content, m.status) for m in store.messages("acme", session.id)]
    assert [r[3] for r in rows[:3]] == ["complete"] * 3
    assert [r[3] for r in rows[3:6]] == ["superseded"] * 3
    assert [(r[1], r[2], r[3]) for r in rows[6:]] == [
        ("assistant", "edited reply 1", "complete"), ("user", "q2'", "complete"), ("assistant", "a2'", "complete"),
        ("user", "new question", "complete"), ("assistant", "new reply", "complete"),
    ]  # fmt: skip
    assert [r[0] for r in rows] == list(range(11))


def test_an_edit_with_a_bad_role_writes_nothing(store: SessionStore) -> None:
    session = store.create_session("acme")
    turn(store, "acme", session.id, 0)
    with pytest.raises(StoreArgumentError):
        store.append_turn("acme", session.id, "q", "a", prompt_tokens=1, completion_tokens=1, token_count=2,
                          supersede_from=0, earlier=[("system", "no")])
    assert {m.status for m in store.messages("acme", session.id)} == {"complete"}


def test_an_unknown_status_is_rejected_before_writing(store: SessionStore) -> None:
    session = store.create_session("acme")
    with pytest.raises(StoreArgumentError):
        turn(store, "acme", session.id, 0, status="partial")
    assert store.messages("acme", session.id) == []


def test_append_turn_is_atomic_when_a_constraint_fails(store: SessionStore) -> None:
    session = store.create_session("acme")
    # NOT NULL on content fails on the reply, after the session row was already updated.
    with pytest.raises(SessionStoreError):
        store.append_turn(
            "acme", session.id, "question", None,  # type: ignore[arg-type]
            prompt_tokens=1, completion_tokens=1, token_count=99,
        )  # fmt: skip

    assert store.messages("acme", session.id) == []
    assert store.get_session("acme", session.id) == session


def test_append_turn_is_atomic_when_it_fails_mid_transaction(store: SessionStore) -> None:
    session = store.create_session("acme")

    def fail_after_messages_insert(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        # Both messages are written (and the session row updated); the commit never comes.
        if statement.lstrip().upper().startswith("INSERT INTO MESSAGES"):
            raise RuntimeError("injected failure")

    sa.event.listen(Engine, "after_cursor_execute", fail_after_messages_insert)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            turn(store, "acme", session.id, 0, token_count=99)
    finally:
        sa.event.remove(Engine, "after_cursor_execute", fail_after_messages_insert)

    assert store.messages("acme", session.id) == []
    assert store.get_session("acme", session.id) == session
    # The store is still usable, and the failed turn left no gap in the sequence.
    user, reply = turn(store, "acme", session.id, 1)
    assert (user.seq, reply.seq) == (0, 1)


def test_deleting_a_session_deletes_its_messages(store: SessionStore, store_url: str) -> None:
    session = store.create_session("acme")
    turn(store, "acme", session.id, 0)
    turn(store, "acme", session.id, 1)
    assert count_messages(store_url, session.id) == 4

    assert store.delete_session("acme", session.id)
    assert count_messages(store_url, session.id) == 0


def test_the_chunk_catalog_names_each_turns_chunks_once_and_goes_with_its_session(store: SessionStore) -> None:
    a, b = store.create_session("acme"), store.create_session("acme")
    k1, k2, k3, k4 = (bytes([i]) * 16 for i in (1, 2, 3, 4))
    turn(store, "acme", a.id, 0, chunk_store="host:/s", chunk_keys=[k1])
    turn(store, "acme", a.id, 1, chunk_store="host:/s", chunk_keys=[k1, k2, k2])  # a later turn names its chain
    turn(store, "acme", b.id, 0, chunk_store="host:/s", chunk_keys=[k1, k3])  # a shared prefix chunk
    turn(store, "acme", b.id, 1, chunk_store="other:/s", chunk_keys=[k2])  # another daemon's disk
    assert store.cataloged_chunks("host:/s") == {k1, k2, k3}
    assert store.cataloged_chunks("other:/s") == {k2}
    turn(store, "acme", a.id, 2, chunk_store="host:/s", chunk_keys=[k1, k4])  # k2 was its last partial chunk
    turn(store, "acme", a.id, 3)  # no disk tier, or an interrupted turn: the rows stay
    assert store.cataloged_chunks("host:/s") == {k1, k3, k4}
    assert store.delete_session("acme", a.id)
    assert store.cataloged_chunks("host:/s") == {k1, k3}  # k1 is still b's
    assert store.uncatalog_chunks("host:/s", [k1, k2]) == 1
    assert store.cataloged_chunks("host:/s") == {k3} and store.cataloged_chunks("other:/s") == {k2}


def test_recent_session_chunks_come_least_recent_session_first(store: SessionStore) -> None:
    a, b, c = store.create_session("acme"), store.create_session("acme"), store.create_session("acme")
    shared, k1, k2, k3 = (bytes([i]) * 16 for i in (9, 1, 2, 3))
    turn(store, "acme", a.id, 0, chunk_store="host:/s", chunk_keys=[shared, k1])
    turn(store, "acme", b.id, 0, chunk_store="host:/s", chunk_keys=[shared, k2])
    turn(store, "acme", c.id, 0, chunk_store="other:/s", chunk_keys=[k3])  # used later, on another disk
    turn(store, "acme", store.create_session("acme").id, 0)  # used last, with no chunks
    assert store.recent_session_chunks("host:/s", 1) == [k2, shared]  # b's: one turn's chunks come by key
    assert store.recent_session_chunks("host:/s", 5) == [k1, k2, shared]  # a shared chunk with its latest user
    assert store.recent_session_chunks("other:/s", 5) == [k3]


def test_concurrent_turns_on_one_session_get_distinct_seqs(store: SessionStore) -> None:
    session = store.create_session("acme")
    num_threads, turns_each = 8, 3
    start = threading.Barrier(num_threads)

    def worker(t: int) -> None:
        start.wait()
        for i in range(turns_each):
            turn(store, "acme", session.id, t * 100 + i)

    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(worker, range(num_threads)))

    messages = store.messages("acme", session.id)
    assert [m.seq for m in messages] == list(range(2 * num_threads * turns_each))
    # Each reply directly follows its own question.
    for user, reply in zip(messages[::2], messages[1::2], strict=True):
        assert (user.role, reply.role) == ("user", "assistant")
        assert reply.content == user.content.replace("question", "answer")


# --- an unreachable database --------------------------------------------------------------


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections (the kernel's backlog) but never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("port_fixture", ["silent_port", "closed_port"])
def test_an_unreachable_postgres_fails_fast(port_fixture: str, request: pytest.FixtureRequest) -> None:
    port = request.getfixturevalue(port_fixture)
    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/kvtierd"

    # A silent server never answers and no TCP timeout ends the wait: without timeout_s this would hang for
    # good. The guard tells that hang apart from a slow failure; it is no speed bound.
    outcome: queue.Queue[BaseException | None] = queue.Queue()

    def connect() -> None:
        try:
            SessionStore(url, timeout_s=2)
            outcome.put(None)
        except BaseException as e:  # handed to the test's thread
            outcome.put(e)

    threading.Thread(target=connect, daemon=True).start()
    try:
        error = outcome.get(timeout=HANG_GUARD_S)
    except queue.Empty:
        pytest.fail(f"hung: connecting to {port_fixture} did not fail in {HANG_GUARD_S:.0f} s (timeout_s is 2)")
    assert isinstance(error, StoreUnavailableError), error
    assert "127.0.0.1" in str(error)
    assert not isinstance(error, sa.exc.SQLAlchemyError)


def test_a_bad_url_is_an_argument_error() -> None:
    with pytest.raises(StoreArgumentError):
        SessionStore("not a url")
    with pytest.raises(StoreArgumentError):
        SessionStore("nosuchdialect://x/y")
