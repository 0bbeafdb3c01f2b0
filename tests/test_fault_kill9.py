"""kill -9 in a loop while several sessions offload hard, then restart on the same state directory.

The device pool is 34 pages and three clients run four-turn sessions side by side, so pages are evicted
to the host slab and to disk all the time (every evicted chunk is written to disk, and each finished turn
is written through). Once every client has finished a turn, the daemon is killed with SIGKILL, at a
moment when the disk writer holds chunks it has not committed yet (when one comes within a random wait).
After each restart:

- it starts, and its disk tier opens healthy, with no value failing its checks (a torn value would);
- every turn a client saw complete is in the session store, whole and in order (at most one more turn,
  the one in flight at the kill, whose reply the client never read);
- each client's session continues with a turn whose reply (greedy text and logprobs, its KV loaded from
  disk) equals a cold computation of the same conversation by a tenant with nothing cached.

At the end, after a clean stop, the disk tier's two indexes (values and their LRU records) hold the same
keys.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import httpx

from daemon_fixtures import Daemon, start_daemon
from waiting import wait_until
from fault_fixtures import (OFFLOAD_ENV, checked_session_turns, kill9, new_session, question, remove_root, report,
                            short_root, stop_cleanly, stored_keys, stored_turns, system_prompt, tiers)

KILLS = 3
CLIENTS = 3
TURNS_PER_SESSION = 4  # then the client starts a new session: prompts stay well inside the 34-page pool
SEED = 8
# Disk writes run beside the steps (not deferred to idle spells, which this load leaves none of), so the kills
# land in the middle of writes and something is on disk at each restart.
KILL_ENV = {**OFFLOAD_ENV, "KVTIERD_STORE_DEFER_MS": "0"}


@dataclass
class Conversation:
    sid: str
    system: str
    seen: list[tuple[str, str]] = field(default_factory=list)  # turns the client saw complete


@dataclass
class Client:
    index: int
    conversations: list[Conversation] = field(default_factory=list)
    asked: int = 0

    @property
    def current(self) -> Conversation:
        return self.conversations[-1]


class Load:
    """The clients' threads: each sends its sessions' turns back to back until the daemon goes away."""

    def __init__(self, daemon: Daemon, clients: list[Client]) -> None:
        self.daemon = daemon
        self.clients = clients
        self.completed = [0] * len(clients)  # turns completed in this run
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in clients]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self) -> None:
        for t in self._threads:
            t.join(60)
            assert not t.is_alive(), "a client is still waiting 60 s after the kill"

    def _run(self, client: Client) -> None:
        with self.daemon.client() as c:
            while True:
                try:
                    if len(client.current.seen) >= TURNS_PER_SESSION:
                        n = client.index + CLIENTS * len(client.conversations)
                        system = system_prompt(n)
                        client.conversations.append(Conversation(new_session(c, system), system))
                    conv = client.current
                    client.asked += 1
                    content = question(client.index * 1000 + client.asked)
                    r = c.post(f"/v1/sessions/{conv.sid}/messages",
                               json={"content": content, "temperature": 0, "max_tokens": 8})
                except httpx.TransportError:
                    return  # killed
                if r.status_code != 200:
                    self.errors.append(f"{r.status_code}: {r.text[:300]}")
                    return
                conv.seen.append((content, r.json()["choices"][0]["message"]["content"]))
                self.completed[client.index] += 1


def while_writing_to_disk(daemon: Daemon, timeout: float) -> dict[str, dict]:
    """Waits (up to `timeout`) for a moment when the disk writer holds chunks it has not committed, so
    the kill lands in the middle of a write; returns the tiers' stats of that moment."""
    deadline = time.monotonic() + timeout
    with daemon.client() as c:
        while (t := tiers(c))["disk"]["pending_writes"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    return t


def check_sessions_after_kill(c: httpx.Client, clients: list[Client]) -> tuple[int, int]:
    """Every turn a client saw is stored; returns (turns checked, turns stored that no client saw)."""
    checked = unseen = 0
    for client in clients:
        for conv in client.conversations:
            system, stored = stored_turns(c, conv.sid)
            assert system == conv.system
            assert stored[: len(conv.seen)] == conv.seen, (conv.sid, stored, conv.seen)
            extra = len(stored) - len(conv.seen)
            assert extra in (0, 1), f"{conv.sid}: {extra} turns stored that no client saw complete"
            checked += len(conv.seen)
            unseen += extra
            conv.seen = stored  # the one in flight at the kill is part of the conversation now
    return checked, unseen


def test_kill_9_in_a_loop_during_heavy_offload(capsys):
    started = time.monotonic()
    rng = random.Random(SEED)
    root = short_root()
    clients = [Client(i) for i in range(CLIENTS)]
    figures = {"kills survived": 0, "turns completed before kills": 0, "stored turns checked": 0,
               "turns stored unseen": 0, "replies checked against cold": 0, "disk hit tokens": 0,
               "device evictions": 0, "disk writes": 0, "kills during disk writes": 0}
    daemon = start_daemon(root, env=KILL_ENV)
    try:
        with daemon.client() as c:
            for client in clients:
                system = system_prompt(client.index)
                client.conversations.append(Conversation(new_session(c, system), system))
        for _ in range(KILLS):
            load = Load(daemon, clients)
            load.start()
            wait_until(lambda: min(load.completed) >= 1 or load.errors,  # every client well into its session
                       "every client completing a turn")
            t = while_writing_to_disk(daemon, rng.uniform(0.5, 2.0))
            kill9(daemon)
            load.join()
            assert not load.errors, load.errors
            figures["turns completed before kills"] += sum(load.completed)
            figures["device evictions"] += t["device"]["evictions"]["capacity"]
            figures["disk writes"] += t["disk"]["writes"]
            figures["kills during disk writes"] += t["disk"]["pending_writes"] > 0

            daemon = start_daemon(root, env=KILL_ENV)  # replaces the stale socket
            figures["kills survived"] += 1
            with daemon.client() as c:
                disk = tiers(c)["disk"]
                assert disk["enabled"] and disk["healthy"] and disk["reason"] is None, disk
                assert disk["entries"] > 0 and disk["corrupt"] == 0, disk
                checked, unseen = check_sessions_after_kill(c, clients)
                figures["stored turns checked"] += checked
                figures["turns stored unseen"] += unseen
            # Each session continues, from disk, as a cold run would answer.
            contents = []
            for client in clients:
                client.asked += 1
                contents.append(question(client.index * 1000 + client.asked))
            sids = [client.current.sid for client in clients]
            turns = checked_session_turns(daemon, list(zip(sids, contents, strict=True)))
            for client, content, turn in zip(clients, contents, turns, strict=True):
                client.current.seen.append((content, turn.text))
                figures["replies checked against cold"] += 1
                figures["disk hit tokens"] += turn.cached_by_tier["disk"]
            with daemon.client() as c:
                assert tiers(c)["disk"]["corrupt"] == 0
        assert figures["device evictions"] > 0 and figures["disk writes"] > 0, figures  # it did offload
        assert figures["disk hit tokens"] > 0, figures  # and the restarted daemons loaded from disk
        stop_cleanly(daemon)
        kv = daemon.state_dir / "kv"
        values, order = stored_keys(kv, "values"), stored_keys(kv, "order")
        assert values == order, (len(values), len(order))
        figures["disk values reconciled"] = len(values)
    except BaseException:
        print(f"the last daemon's log:\n{daemon.log_text()[-6000:]}")  # what CI shows of a failure
        raise
    finally:
        kill9(daemon)
        remove_root(root)
    report(capsys, "kill -9 loop", **figures, seconds=round(time.monotonic() - started))
