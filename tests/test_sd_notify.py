"""The daemon reports to systemd (Type=notify) over a real $NOTIFY_SOCKET datagram socket.

A real `kvtierd serve` process: EXTEND_TIMEOUT_USEC while the model loads,
READY=1 only once /healthz answers, STATUS= lines with the engine's state,
WATCHDOG=1 every WatchdogSec/2 (also while the engine works), STOPPING=1 on
SIGTERM. In process: the watchdog pings stop while an engine step hangs and
resume when it returns; the client itself (abstract sockets, no-op outside
systemd, WATCHDOG_PID).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import threading
import time
import uuid

import pytest
from daemon_fixtures import start_daemon
from waiting import HANG_GUARD_S

from kvtierd.engine.async_engine import AsyncEngine
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.server.daemon import heartbeat
from kvtierd.server.sd_notify import notify, watchdog_period

STATUS = re.compile(r"^STATUS=serving; (\d+) running, (\d+) waiting, (\d+)/(\d+) pages used$")
STORY = [{"role": "user", "content": "Count from one to one hundred in words, separated by commas."}]


class NotifyListener:
    """The receiving end of $NOTIFY_SOCKET: what systemd would read, with arrival times."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.received: list[tuple[float, list[str]]] = []

    def receive(self, timeout: float) -> list[str] | None:
        self.sock.settimeout(timeout)
        try:
            lines = self.sock.recv(4096).decode().split("\n")
        except TimeoutError:
            return None
        self.received.append((time.monotonic(), lines))
        return lines

    def until(self, line: str, timeout: float) -> list[str]:
        """Receives datagrams until one holds `line` (or a line starting with it); returns that one."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            lines = self.receive(left)
            if lines and any(x.startswith(line) for x in lines):
                return lines
        pytest.fail(f"no {line} within {timeout} s; received {[m for _, m in self.received]}")

    def lines(self) -> list[str]:
        return [x for _, m in self.received for x in m]

    def close(self) -> None:
        self.sock.close()


def test_daemon_reports_loading_ready_status_watchdog_and_stopping(tmp_path):
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    d = start_daemon(tmp_path, wait=False, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
                                                "WATCHDOG_USEC": "3000000"})  # pings every 1.5 s
    try:
        ready = listener.until("READY=1", timeout=HANG_GUARD_S)
        with d.client() as c:  # the socket serves at once: no retry
            assert c.get("/healthz").status_code == 200
        assert any(x.startswith("EXTEND_TIMEOUT_USEC=") for _, m in listener.received[:-1] for x in m), \
            listener.received  # before READY=1: while the model loaded
        assert any(STATUS.match(x) for x in ready), ready

        # While a request runs, the pings go on (between steps) and STATUS= counts it. STORY's greedy reply runs
        # past 600 tokens: still running at the next ping even on a fast machine; leaving the stream cancels it.
        with d.client() as c, c.stream("POST", "/v1/chat/completions",
                                       json={"messages": STORY, "max_tokens": 2000, "temperature": 0,
                                             "stream": True}) as r:
            assert r.status_code == 200
            busy = listener.until("STATUS=serving; 1 running", timeout=HANG_GUARD_S)
        assert "WATCHDOG=1" in busy

        # The pings go on: each comes with a STATUS= line the engine computed between two steps.
        for _ in range(3):
            ping = listener.until("WATCHDOG=1", timeout=HANG_GUARD_S)
            assert any(STATUS.match(x) for x in ping), ping
        assert all(STATUS.match(x) for x in listener.lines() if x.startswith("STATUS=serving"))

        d.process.send_signal(signal.SIGTERM)
        stopping = listener.until("STOPPING=1", timeout=HANG_GUARD_S)
        assert any(x.startswith("EXTEND_TIMEOUT_USEC=") for x in stopping), stopping  # room for the drain
        assert d.process.wait(60) == 0, d.log_text()
    finally:
        listener.close()
        if d.process.poll() is None:
            d.process.kill()
            d.process.wait()


def test_watchdog_pings_stop_while_an_engine_step_hangs(loaded, make_engine, monkeypatch, tmp_path):
    """A ping carries a status the engine computed between two steps, so a hung step stops the pings: no
    ping is ever sent for a status computed while the step hung, and they resume once it returns."""
    address = str(tmp_path / "notify.sock")
    listener = NotifyListener(address)
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # pings every 0.2 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    sync_engine = make_engine()
    step, in_step, release = sync_engine.step, threading.Event(), threading.Event()

    def hanging_step():
        in_step.set()
        release.wait()
        return step()

    sync_engine.step = hanging_step

    def status() -> str:  # says whether the step was hung when the engine computed it
        return f"STATUS=hung={in_step.is_set() and not release.is_set()}"

    def pings_for(seconds: float) -> list[list[str]]:
        end, pings = time.monotonic() + seconds, []
        while (left := end - time.monotonic()) > 0:
            if "WATCHDOG=1" in (lines := listener.receive(left) or []):
                pings.append(lines)
        return pings

    async def request(engine: AsyncEngine) -> None:
        async for _ in engine.generate(chat_ids, SamplingParams(max_tokens=2, temperature=0.0)):
            pass

    async def main() -> None:
        engine = AsyncEngine(sync_engine)
        await engine.start()
        pinger = asyncio.create_task(heartbeat(engine, status))
        generation = asyncio.create_task(request(engine))
        try:
            assert await asyncio.to_thread(in_step.wait, HANG_GUARD_S)
            # Six watchdog periods of a hung step: a window for a wrong ping to show, not a speed bound.
            during = await asyncio.to_thread(pings_for, 1.2)
            assert all("STATUS=hung=False" in p for p in during), during  # at most one computed before the hang
            assert len(during) <= 1, during
            release.set()
            resumed = [await asyncio.to_thread(listener.until, "WATCHDOG=1", HANG_GUARD_S) for _ in range(2)]
            assert all("STATUS=hung=False" in p for p in resumed), resumed
            await generation
        finally:
            release.set()
            pinger.cancel()
            generation.cancel()
            await engine.stop()

    chat_ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    try:
        asyncio.run(main())
    finally:
        listener.close()


# --- the client --------------------------------------------------------------------------------------------

def test_notify_sends_one_datagram_to_an_abstract_socket(monkeypatch):
    name = f"kvtierd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind("\0" + name)
        receiver.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("READY=1", "STATUS=serving")
        assert receiver.recv(4096) == b"READY=1\nSTATUS=serving"


def test_notify_is_a_no_op_outside_systemd(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    sent = []
    monkeypatch.setattr(socket, "socket", lambda *a, **k: sent.append(a))  # any socket opened would be seen
    assert notify("READY=1") is False and sent == []  # nothing to send to, nothing raised


def test_notify_to_a_vanished_socket_only_warns(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert notify("WATCHDOG=1") is False
    assert "sd_notify" in caplog.text


@pytest.mark.parametrize("environ,period", [
    ({}, None),
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "{pid}"}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
])
def test_watchdog_period_is_half_of_watchdog_usec(monkeypatch, environ, period):
    for name in ("WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value.format(pid=os.getpid()))
    assert watchdog_period() == period
