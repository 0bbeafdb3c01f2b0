"""Real redis-server processes for the tests: one server, a 3-master Cluster, a Sentinel.

Debian's binary (/usr/bin/redis-server, or KVTIERD_REDIS_SERVER) on 127.0.0.1
and free ports, without persistence, in a temporary directory. A server can be
stopped, paused (SIGSTOP: a server that hangs) and started again on its port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

REDIS_SERVER = Path(os.environ.get("KVTIERD_REDIS_SERVER", "/usr/bin/redis-server"))
REDIS_CLI = REDIS_SERVER.with_name("redis-cli")
START_TIMEOUT_S = 60.0  # a hang guard for a server that starts in milliseconds, no speed bound
CLUSTER_BUS_OFFSET = 10000  # a Cluster node also listens on port + 10000


@dataclass
class RedisServer:
    port: int
    directory: Path
    args: tuple[str, ...] = ()
    config: Path | None = None  # a config file, for a Sentinel (which rewrites it)
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        """A plain client, for looking at (and tampering with) what the store wrote."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> RedisServer:
        assert self.process is None, "already running"
        head = [str(self.config)] if self.config else []  # redis-server takes its config file first
        argv = [str(REDIS_SERVER), *head, *self._base_args(), *self.args]
        with open(self.directory / f"redis-{self.port}.log", "ab") as log:
            self.process = subprocess.Popen(argv, cwd=self.directory, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"redis-server exited with {self.process.returncode}: {self._log_tail()}")
            try:
                with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5) as probe:
                    if probe.ping():
                        return self
            except redis.ConnectionError:
                time.sleep(0.02)
        self.stop()
        pytest.fail(f"redis-server on port {self.port} did not answer in {START_TIMEOUT_S} s: {self._log_tail()}")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def _base_args(self) -> list[str]:
        return ["--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory),
                "--save", "", "--appendonly", "no", "--daemonize", "no"]

    def _log_tail(self) -> str:
        log = self.directory / f"redis-{self.port}.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""


class RedisFactory:
    """Starts servers in one directory and stops them all at the end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.servers: list[RedisServer] = []

    def server(self, *args: str) -> RedisServer:
        s = RedisServer(free_port(), self.directory, args)
        self.servers.append(s)
        return s.start()

    def cluster(self, num_masters: int = 3) -> list[RedisServer]:
        """A Cluster of masters without replicas, its slots spread by redis-cli, ready for keys."""
        nodes = []
        for _ in range(num_masters):
            port = free_port(also=CLUSTER_BUS_OFFSET)
            node = RedisServer(port, self.directory, ("--cluster-enabled", "yes",
                                                      "--cluster-config-file", f"nodes-{port}.conf"))
            self.servers.append(node)
            nodes.append(node.start())
        create = [str(REDIS_CLI), "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                  "--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            pytest.fail(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(_cluster_ok(n) for n in nodes):
            if time.monotonic() > deadline:
                pytest.fail("the Cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        return nodes

    def sentinel(self, master: RedisServer, service_name: str) -> RedisServer:
        """A Sentinel watching `master` as `service_name` (it rewrites its config file, so it gets one)."""
        port = free_port()
        config = self.directory / f"sentinel-{port}.conf"
        config.write_text(f"sentinel monitor {service_name} 127.0.0.1 {master.port} 1\n")
        s = RedisServer(port, self.directory, ("--sentinel",), config=config)
        self.servers.append(s)
        return s.start()

    def stop_all(self) -> None:
        for s in self.servers:
            s.stop()


def free_port(also: int = 0) -> int:
    """A port free on 127.0.0.1 now (and port + `also` too, when given)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not also:
            return port
        if port + also < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + also))
                    return port
                except OSError:
                    continue


def _cluster_ok(node: RedisServer) -> bool:
    with node.client() as c:
        return c.cluster("info")["cluster_state"] == "ok"


def _require_binary() -> None:
    if not REDIS_SERVER.exists():
        message = f"{REDIS_SERVER} not found (apt-get install redis-server, or set KVTIERD_REDIS_SERVER)"
        if os.environ.get("KVTIERD_SKIP_REDIS") == "1":
            pytest.skip(message)
        pytest.fail(message)


@pytest.fixture(scope="module")
def redis_factory() -> Iterator[RedisFactory]:
    """Starts redis-server processes for one test module, and stops them after it."""
    _require_binary()
    directory = Path(tempfile.mkdtemp(prefix="kvtierd-redis-"))
    factory = RedisFactory(directory)
    try:
        yield factory
    finally:
        factory.stop_all()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def redis_server(redis_factory: RedisFactory) -> RedisServer:
    """One plain redis-server for the module."""
    return redis_factory.server()


@pytest.fixture
def empty_redis(redis_server: RedisServer) -> RedisServer:
    """The module's redis-server, emptied for this test."""
    with redis_server.client() as raw:
        raw.flushall()
    return redis_server


class GatedProxy:
    """A TCP proxy to a redis-server that, while held, keeps each new call (the first bytes a client sends
    after the server last answered it) until released: a Redis that stops answering, on the test's cue."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._open = threading.Event()
        self._open.set()
        self.held = 0  # calls that found the proxy held
        self._held_changed = threading.Condition()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="gated-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def wait_held(self, n: int, guard_s: float = 120.0) -> bool:
        """Waits until `n` calls have found the proxy held (False past a guard that only stops a hang)."""
        with self._held_changed:
            return self._held_changed.wait_for(lambda: self.held >= n, timeout=guard_s)

    def close(self) -> None:
        self._open.set()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            answered = threading.Event()
            answered.set()
            for src, dst, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, answered, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answered: threading.Event, up: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if not up:
                    answered.set()
                elif answered.is_set():
                    answered.clear()
                    if not self._open.is_set():
                        with self._held_changed:
                            self.held += 1
                            self._held_changed.notify_all()
                        self._open.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
