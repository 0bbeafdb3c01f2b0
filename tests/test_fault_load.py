"""Faults under load on one daemon that offloads hard: clients that hang up at random, then SIGTERM
while streams run.

- Hang-ups: six clients send streamed and whole chats and streamed session turns, and each hangs up at
  a random point (before the reply starts, after a few events, mid-wait for a whole reply) or reads to the
  end. Afterwards no request runs or waits, no page is held, no stream is open, no 5xx was answered, and
  every session holds whole turns only, its next turn equal to a cold computation.
- Drain (tests/test_daemon_errors.py drains one stream on an idle daemon; here six requests of three
  kinds run at once, on a daemon with tiers): SIGTERM lets each in-flight request finish (streams end with
  a finish reason and [DONE] after the signal), new requests get 503 or find the socket gone, the exit
  code is 0.

The daemon's socket lives in a directory that does not exist before the start: the daemon makes it, private.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from daemon_fixtures import Daemon, start_daemon, wait_ready
from daemon_fixtures import wait_idle
from fault_fixtures import (OFFLOAD_ENV, checked_session_turns, errors_5xx, kill9, metrics, new_session, question, remove_root, report, short_root, stored_turns, system_prompt)

CHAT = "/v1/chat/completions"
SEED = 5
CLIENTS = 6
REQUESTS_PER_CLIENT = 4


class DaemonHolder:
    """The module's daemon; a test that finds it stopped (the drain test stops it) gets a new one."""

    def __init__(self) -> None:
        self.root = short_root()
        self.socket = self.root / "run" / "nested" / "kvtierd.sock"  # neither directory exists yet
        self.daemon: Daemon | None = None

    def get(self) -> Daemon:
        if self.daemon is None or self.daemon.process.poll() is not None:
            self.daemon = start_daemon(self.root, "--socket", str(self.socket), env=OFFLOAD_ENV, wait=False)
            self.daemon.socket = self.socket
            wait_ready(self.daemon)
        return self.daemon


@pytest.fixture(scope="module")
def holder() -> Iterator[DaemonHolder]:
    h = DaemonHolder()
    try:
        yield h
        if h.daemon is not None and h.daemon.process.poll() is None:
            assert h.daemon.stop() == 0, h.daemon.log_text()[-4000:]
    finally:
        if h.daemon is not None:
            kill9(h.daemon)
        remove_root(h.root)


def chat(n: int, **fields: object) -> dict:
    return {"messages": [{"role": "system", "content": system_prompt(n)}, {"role": "user", "content": question(n)}],
            "temperature": 0, "max_tokens": 24, **fields}


def test_a_missing_socket_directory_is_made_private(holder):
    d = holder.get()
    assert stat.S_ISSOCK(d.socket.lstat().st_mode)
    assert stat.S_IMODE(d.socket.parent.stat().st_mode) == 0o700  # (its parents, like mkdir -p's, are not)


# --- clients that hang up ---------------------------------------------------------------------------------

def raw_post(sock_path: Path, path: str, body: dict) -> socket.socket:
    """Sends one HTTP/1.1 POST on a fresh connection and returns the socket, unread."""
    data = json.dumps(body).encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(120)
    s.connect(str(sock_path))
    head = (f"POST {path} HTTP/1.1\r\nHost: kvtierd\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    s.sendall(head.encode() + data)
    return s


def read_events(s: socket.socket, until: int | None) -> tuple[bytes, bool]:
    """Reads SSE until `until` events have come (None: to the end); returns what came and whether [DONE] did."""
    seen = b""
    while b"data: [DONE]" not in seen and (until is None or seen.count(b"data: ") < until):
        chunk = s.recv(65536)
        if not chunk:
            break
        seen += chunk
    return seen, b"data: [DONE]" in seen


@dataclass
class Outcomes:
    counts: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, head: bytes) -> None:
        with self.lock:
            self.counts[outcome] += 1
            if head.startswith(b"HTTP/1.1 "):
                self.statuses[int(head[9:12])] += 1


def hang_up_client(d: Daemon, index: int, sid: str, rng: random.Random, out: Outcomes) -> None:
    for k in range(REQUESTS_PER_CLIENT):
        n = index * 100 + k
        kind = rng.choice(["stream", "stream", "session", "whole", "to-the-end"])
        if kind == "session":
            s = raw_post(d.socket, f"/v1/sessions/{sid}/messages",
                         {"content": question(n), "temperature": 0, "max_tokens": 24, "stream": True})
        elif kind == "whole":
            s = raw_post(d.socket, CHAT, chat(n))
        else:
            s = raw_post(d.socket, CHAT, chat(n, stream=True))
        try:
            if kind == "whole":
                time.sleep(rng.uniform(0.0, 1.5))  # queued or mid-generation: no byte of the reply read
                out.add("hung up waiting for a whole reply", b"")
            elif kind == "to-the-end":
                seen, done = read_events(s, None)
                assert done, seen[-500:]
                out.add("read to the end", seen)
            else:
                after = rng.randrange(0, 6)  # 0: before the reply started (queued, maybe)
                seen, done = read_events(s, after) if after else (b"", False)
                out.add("read to the end" if done else "hung up before the reply" if not after
                        else "hung up mid-stream", seen)
        finally:
            s.close()


def test_clients_that_hang_up_at_random_leave_nothing_behind(holder, capsys):
    d = holder.get()
    rng = random.Random(SEED)
    with d.client() as c:
        base_5xx = errors_5xx(c)
        sessions = [new_session(c, system_prompt(60 + i)) for i in range(CLIENTS)]
    out = Outcomes()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            hang_up_client(d, i, sessions[i], random.Random(rng.random()), out)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    with d.client() as c:
        status = wait_idle(c)  # no request runs or waits, no page is held
        assert metrics(c)[("kvtierd_http_active_streams", ())] == 0
        assert errors_5xx(c) == base_5xx
        assert set(out.statuses) <= {200}, out.statuses
        interrupted = 0
        for sid in sessions:
            messages = c.get(f"/v1/sessions/{sid}").json()["messages"]
            interrupted += sum(m["status"] == "interrupted" for m in messages) // 2
            stored_turns(c, sid, allow_interrupted=True)  # whole turns only
    # The sessions go on from what they stored (interrupted turns left out), as a cold run would answer.
    checked = checked_session_turns(d, [(sid, question(999)) for sid in sessions[:2]], allow_interrupted=True)
    with d.client() as c:
        wait_idle(c)
    assert d.process.poll() is None
    report(capsys, "random hang-ups", requests=sum(out.counts.values()), **dict(out.counts),
           interrupted_turns_stored=interrupted, pages_in_use_after=status["used_blocks"],
           requests_running_after=status["running"] + status["waiting"], turns_checked_against_cold=len(checked),
           **{"5xx seen": 0})


# --- SIGTERM under load ----------------------------------------------------------------------------------------

@dataclass
class InFlight:
    kind: str
    started: threading.Event = field(default_factory=threading.Event)
    payloads: list[str] = field(default_factory=list)
    status: int | None = None
    finished_at: float = 0.0
    error: BaseException | None = None


COUNT = [f"Count from {n} to one hundred in words, separated by commas." for n in
         ("one", "two", "three", "four", "five", "six")]  # long replies: they run to max_tokens


def counting(i: int, **fields: object) -> dict:
    return {"messages": [{"role": "user", "content": COUNT[i]}], "temperature": 0, "max_tokens": 40, **fields}


def delta(payload: str) -> dict:
    return json.loads(payload)["choices"][0]["delta"]


def run_in_flight(d: Daemon, req: InFlight, path: str, body: dict) -> None:
    try:
        with d.client() as c:
            if not body.get("stream"):
                req.started.set()  # it is sent; the caller waits for the streams' first tokens anyway
                r = c.post(path, json=body)
                req.status, req.payloads = r.status_code, [r.text]
            else:
                with c.stream("POST", path, json=body) as r:
                    req.status = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            req.payloads.append(line.removeprefix("data: "))
                            if '"content"' in line and delta(req.payloads[-1]).get("content"):
                                req.started.set()  # its first token came
    except BaseException as e:  # noqa: BLE001 - checked by the test
        req.error = e
    finally:
        req.finished_at = time.monotonic()
        req.started.set()


def test_sigterm_under_load_finishes_in_flight_requests_and_refuses_new_ones(holder, capsys):
    d = holder.get()
    with d.client() as c:
        sid = new_session(c, system_prompt(70))
    requests = [(InFlight("stream"), CHAT, counting(i, stream=True)) for i in range(4)]
    requests.append((InFlight("session stream"), f"/v1/sessions/{sid}/messages",
                     {"content": COUNT[4], "temperature": 0, "max_tokens": 40, "stream": True}))
    requests.append((InFlight("whole"), CHAT, counting(5)))
    threads = [threading.Thread(target=run_in_flight, args=(d, req, path, body)) for req, path, body in requests]
    for t in threads:
        t.start()
    for req, _, _ in requests:
        assert req.started.wait(120), req.kind
    with d.client() as c:
        running = c.get("/admin/status").json()["engine"]
    signalled = time.monotonic()
    d.process.send_signal(signal.SIGTERM)

    late: Counter[str] = Counter()
    refused_since: float | None = None
    with d.client() as c:
        while d.process.poll() is None:
            try:
                r = c.post(CHAT, json=chat(1, max_tokens=1), timeout=10)
            except httpx.TransportError:
                late["connection refused or closed"] += 1  # the socket is gone, or going
                time.sleep(0.05)
                continue
            if r.status_code == 503:
                assert r.headers.get("retry-after") and r.json()["error"]["code"] == "unavailable", r.text
                late["503"] += 1
                refused_since = refused_since or time.monotonic()
            else:  # sent before the daemon saw the signal; never once it refuses
                assert r.status_code == 200 and refused_since is None, (r.status_code, r.text)
                late["served before the signal was seen"] += 1
            time.sleep(0.05)
    for t in threads:
        t.join(60)
    assert d.process.wait(60) == 0, d.log_text()[-4000:]
    assert late["503"] > 0, late
    for req, _, _ in requests:
        assert req.error is None and req.status == 200, (req.kind, req.error, req.status)
        assert req.finished_at > signalled, req.kind  # it was still running when the signal came
        if req.kind == "whole":
            assert json.loads(req.payloads[0])["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            assert req.payloads[-1] == "[DONE]", (req.kind, req.payloads[-3:])
            assert json.loads(req.payloads[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    assert not d.socket.exists()
    log = d.log_text()
    drained = int(log.split("draining: ")[1].split(" request(s)")[0])
    assert drained >= len(requests), log[-2000:]
    assert "flushed to the disk tier" in log and "Traceback" not in log
    report(capsys, "SIGTERM drain", in_flight_at_sigterm=drained, engine_running_at_sigterm=running["running"],
           finished_after_sigterm=f"{len(requests)}/{len(requests)}", **{f"late: {k}": v for k, v in late.items()},
           exit_code=0, drain_seconds=round(time.monotonic() - signalled, 1))
