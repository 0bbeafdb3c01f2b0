"""Shared fixtures: a throwaway PostgreSQL 15 cluster started and stopped by the tests."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# The daemons the tests start share one converted-model cache: the first converts the GGUF, the rest map
# it (each daemon's own state dir is new, so its default cache would be empty every time).
MODEL_CACHE_DIR = tempfile.mkdtemp(prefix="kvtierd-model-cache-")
os.environ.setdefault("KVTIERD_MODEL_CACHE_DIR", MODEL_CACHE_DIR)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(MODEL_CACHE_DIR, ignore_errors=True)


PG_BIN = Path(os.environ.get("KVTIERD_PG_BIN", "/usr/lib/postgresql/15/bin"))
# initdb refuses to run as root, so root runs the cluster as this user (created if missing).
PG_OS_USER_CANDIDATES = ("nobody", "kvtierd-test")
# Unix socket only: the port just names the socket file inside our private directory.
PG_PORT = 5432


@dataclass(frozen=True)
class PostgresServer:
    bin_dir: Path
    socket_dir: Path
    port: int
    data_dir: Path
    log: Path
    options: str
    os_user: str | None

    def stop(self) -> None:
        """Stops the server (a test of the daemon without its database must start it again)."""
        self._pg_ctl("-m", "fast", "-w", "stop")

    def start(self) -> None:
        self._pg_ctl("-l", self.log, "-o", self.options, "-w", "-t", "30", "start")

    def _pg_ctl(self, *args: object) -> None:
        subprocess.run(_as_user(self.os_user, self.bin_dir / "pg_ctl", "-D", self.data_dir, *args),
                       cwd=self.data_dir.parent, check=True, capture_output=True)

    def url(self, dbname: str) -> str:
        return f"postgresql+psycopg://postgres@/{dbname}?host={self.socket_dir}&port={self.port}"

    def create_database(self, dbname: str) -> str:
        """Create an empty database and return its SQLAlchemy URL."""
        subprocess.run(
            [self.bin_dir / "createdb", "-h", self.socket_dir, "-p", str(self.port), "-U", "postgres", dbname],
            check=True,
            capture_output=True,
            text=True,
        )
        return self.url(dbname)


def _os_user() -> str | None:
    """The unprivileged user to run postgres as, or None when we are not root."""
    if os.geteuid() != 0:
        return None
    for name in PG_OS_USER_CANDIDATES:
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    name = PG_OS_USER_CANDIDATES[-1]
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    return name


def _as_user(user: str | None, *argv: object) -> list[str]:
    prefix = ["runuser", "-u", user, "--"] if user else []
    return prefix + [str(a) for a in argv]


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    initdb, pg_ctl = PG_BIN / "initdb", PG_BIN / "pg_ctl"
    if not (initdb.exists() and pg_ctl.exists()):
        message = (
            f"PostgreSQL binaries not found under {PG_BIN} (install postgresql-15, or point "
            "KVTIERD_PG_BIN at its bin dir); set KVTIERD_SKIP_POSTGRES=1 to skip these tests"
        )
        if os.environ.get("KVTIERD_SKIP_POSTGRES") == "1":
            pytest.skip(message)
        pytest.fail(message)

    user = _os_user()
    # A short path under /tmp: Unix socket paths are limited to ~107 bytes.
    base = Path(tempfile.mkdtemp(prefix="kvtierd-pg-"))
    base.chmod(0o755)  # mkdtemp makes it 0700, which the postgres user could not enter
    data, sockets, log = base / "data", base / "sock", base / "server.log"
    for d in (data, sockets):
        d.mkdir()
    if user:
        for p in (data, sockets):
            shutil.chown(p, user)
        log.touch()
        shutil.chown(log, user)

    def run(*argv: object) -> None:
        done = subprocess.run(_as_user(user, *argv), cwd=base, capture_output=True, text=True)
        if done.returncode != 0:
            server_log = log.read_text() if log.exists() else ""
            pytest.fail(f"{argv[0]} failed ({done.returncode}):\n{done.stdout}{done.stderr}{server_log}")

    # A throwaway cluster: durability settings off for speed.
    options = f"-k {sockets} -p {PG_PORT} -c listen_addresses='' -c fsync=off -c synchronous_commit=off"
    try:
        run(initdb, "-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C")
        run(pg_ctl, "-D", data, "-l", log, "-o", options, "-w", "-t", "30", "start")
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise
    try:
        yield PostgresServer(bin_dir=PG_BIN, socket_dir=sockets, port=PG_PORT, data_dir=data, log=log, options=options,
                             os_user=user)
    finally:
        subprocess.run(_as_user(user, pg_ctl, "-D", data, "-m", "fast", "-w", "stop"), cwd=base, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """URL of an empty database `kvtierd` on the session's PostgreSQL server."""
    return postgres_server.create_database("kvtierd")


# The real model and the transformers oracle, loaded once per session.
from model_fixtures import hf_oracle, loaded, make_engine  # noqa: E402,F401
from daemon_fixtures import daemon, lookups_waited  # noqa: E402,F401
# Real redis-server processes (one server, a Cluster, a Sentinel), started per test module.
from redis_fixtures import empty_redis, redis_factory, redis_server  # noqa: E402,F401
