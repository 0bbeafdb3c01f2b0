"""What the fault suite (tests/test_fault_*.py) shares: settings that make a daemon offload hard;
session turns checked against a cold computation; the disk tier's LMDB file; a small filesystem; the
figures each test prints.

A reply is checked against a *cold* computation: the same messages sent by a tenant nobody used before,
whose namespace holds no cached page in any tier, so whatever KV the first reply was served from (device,
host or disk, after a kill or a corruption), its greedy text and logprobs must equal a fresh prefill's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import httpx
import lmdb
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_fixtures import Daemon
from waiting import wait_until

T = TypeVar("T")

TENANT = "X-Kvtierd-Tenant"  # the default tenant header; the tests run as root, an admin, so they may name one
GREEDY = {"temperature": 0, "max_tokens": 8, "logprobs": True}
LOGPROB_TOLERANCE = 1e-3  # KV loaded from a tier vs. recomputed: float32 on CPU, different batch shapes

# Heavy offload with the bundled model on CPU (float32): a page of 16 tokens is 720 KiB, so the device
# pool holds 34 pages, a chunk is 2 pages, the host slab 4 chunks, and every evicted chunk goes to disk too.
OFFLOAD_ENV = {
    "KVTIERD_KV_CACHE_BYTES": "24MiB",
    "KVTIERD_HOST_BYTES": "6MiB",
    "KVTIERD_DISK_BYTES": "256MiB",
    "KVTIERD_CHUNK_PAGES": "2",
    "KVTIERD_DISK_ADMISSION": "all",
    "KVTIERD_MAX_MODEL_LEN": "1024",
}

TOPICS = ("paging", "pinning", "prefix reuse", "eviction", "write-back", "checksums", "LMDB", "zstd", "Valkey",
          "sessions", "quotas", "drains", "watchdogs", "page tables", "copy on write", "chunked prefill")


def system_prompt(n: int) -> str:
    """A system prompt of about 60 tokens, different for every n (so sessions share no pages)."""
    topic = TOPICS[n % len(TOPICS)]
    return (f"You are assistant number {n}, an expert on {topic} in KV-cache daemons. Answer in one short, "
            f"plain sentence. Mention {topic} when it helps, and never use lists. Session tag {n * 7919 % 10007}.")


def question(n: int) -> str:
    return f"Question {n}: what does {TOPICS[n % len(TOPICS)]} have to do with {TOPICS[(3 * n + 1) % len(TOPICS)]}?"


# --- daemons -------------------------------------------------------------------------------------

def short_root() -> Path:
    """A fresh directory under /tmp: a Unix socket path is limited to ~107 bytes."""
    return Path(tempfile.mkdtemp(prefix="kvtf-", dir="/tmp"))


def kill9(d: Daemon) -> None:
    if d.process.poll() is None:
        d.process.kill()
    d.process.wait(30)


def stop_cleanly(d: Daemon) -> None:
    """SIGTERM: the daemon drains, flushes its tiers and exits 0."""
    assert d.stop() == 0, d.log_text()[-4000:]


def tiers(c: httpx.Client) -> dict[str, dict]:
    return {t["name"]: t for t in c.get("/admin/tiers").json()["tiers"]}


def metrics(c: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}, parsed by prometheus-client's own parser."""
    r = c.get("/metrics")
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def disk_metric(c: httpx.Client, name: str) -> float:
    return metrics(c)[(name, (("tier", "disk"),))]




def wait_disk_settled(c: httpx.Client) -> dict:
    """Waits until the disk writer has committed what it was given; returns the disk tier's stats."""

    def settled() -> dict | None:
        disk = tiers(c)["disk"]
        return None if disk["pending_writes"] else disk

    return wait_until(settled, "the disk writer committing what it was given")


def errors_5xx(c: httpx.Client) -> int:
    return c.get("/admin/stats").json()["errors_5xx"]


# --- sessions and the cold check -------------------------------------------------------------------

def new_session(c: httpx.Client, system: str) -> str:
    r = c.post("/v1/sessions", json={"system_prompt": system})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def session_turn(c: httpx.Client, sid: str, content: str, **options: object) -> dict:
    r = c.post(f"/v1/sessions/{sid}/messages", json={"content": content, **GREEDY, **options})
    assert r.status_code == 200, r.text
    return r.json()


def stored_turns(c: httpx.Client, sid: str, allow_interrupted: bool = False) -> tuple[str, list[tuple[str, str]]]:
    """A session's system prompt and its complete turns as (user, assistant) pairs. Every turn is whole:
    a user message and its reply, both complete (or both interrupted, where that is allowed)."""
    r = c.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    body = r.json()
    messages = body["messages"]
    roles = [m["role"] for m in messages]
    assert roles == ["user", "assistant"] * (len(messages) // 2), roles  # never half a turn
    turns = [(messages[i], messages[i + 1]) for i in range(0, len(messages), 2)]
    statuses = [(user["status"], reply["status"]) for user, reply in turns]
    allowed = {("complete", "complete")} | ({("interrupted", "interrupted")} if allow_interrupted else set())
    assert set(statuses) <= allowed, statuses
    return body["system_prompt"], [(u["content"], a["content"]) for u, a in turns if u["status"] == "complete"]


def history(system: str, pairs: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    out = [{"role": "system", "content": system}]
    for user, assistant in pairs:
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return out


def cold_reply(c: httpx.Client, messages: list[dict[str, str]]) -> dict:
    """The same prompt computed from nothing: a tenant never seen before has no cached page anywhere."""
    r = c.post("/v1/chat/completions", json={"messages": messages, **GREEDY},
               headers={TENANT: f"cold-{uuid.uuid4().hex[:12]}"})
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, reply["usage"]
    return reply


def text_and_logprobs(reply: dict) -> tuple[str, list[float]]:
    choice = reply["choices"][0]
    return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]


def assert_same_as_cold(reply: dict, cold: dict) -> None:
    text, logprobs = text_and_logprobs(reply)
    cold_text, cold_logprobs = text_and_logprobs(cold)
    assert reply["usage"]["prompt_tokens"] == cold["usage"]["prompt_tokens"], (reply["usage"], cold["usage"])
    assert text == cold_text, (text, cold_text, reply["kvtierd"])
    assert logprobs == pytest.approx(cold_logprobs, abs=LOGPROB_TOLERANCE), reply["kvtierd"]


@dataclass
class CheckedTurn:
    reply: dict
    cached_by_tier: dict[str, int]

    @property
    def text(self) -> str:
        return self.reply["choices"][0]["message"]["content"]


def in_parallel(d: Daemon, calls: Sequence[Callable[[httpx.Client], T]]) -> list[T]:
    """Runs each call on a client of its own, all at once (the engine batches them); results in order."""
    def run(call: Callable[[httpx.Client], T]) -> T:
        with d.client() as c:
            return call(c)

    with ThreadPoolExecutor(max_workers=len(calls) or 1) as pool:
        return list(pool.map(run, calls))


def checked_session_turns(d: Daemon, turns: Sequence[tuple[str, str]], allow_interrupted: bool = False
                          ) -> list[CheckedTurn]:
    """Session turns (session id, user message), sent side by side, whose replies must each equal the cold
    computation of the same conversation (its complete turns; sent side by side afterwards)."""
    with d.client() as c:
        prompts = [history(*stored_turns(c, sid, allow_interrupted)) + [{"role": "user", "content": content}]
                   for sid, content in turns]
    replies = in_parallel(d, [partial(session_turn, sid=sid, content=content) for sid, content in turns])
    colds = in_parallel(d, [partial(cold_reply, messages=messages) for messages in prompts])
    for reply, cold in zip(replies, colds, strict=True):
        assert_same_as_cold(reply, cold)
    return [CheckedTurn(r, r["kvtierd"]["cached_tokens_by_tier"]) for r in replies]


# --- the disk tier's LMDB file (only while no daemon has it open) ----------------------------------------

@contextlib.contextmanager
def open_kv(kv_dir: Path, write: bool = False) -> Iterator[tuple[lmdb.Environment, dict[str, object]]]:
    """The disk tier's environment and its sub-databases (values, order, quarantine, places)."""
    size = (kv_dir / "data.mdb").stat().st_size
    env = lmdb.open(str(kv_dir), subdir=True, create=False, readonly=not write, lock=write, max_dbs=4,
                    map_size=max(size * 2, 64 << 20))
    try:
        dbs = {name: env.open_db(name.encode(), create=False) for name in ("values", "order", "quarantine", "places")}
        yield env, dbs
    finally:
        env.close()


def stored_keys(kv_dir: Path, db: str) -> set[bytes]:
    with open_kv(kv_dir) as (env, dbs), env.begin() as txn:
        return {bytes(k) for k, _ in txn.cursor(db=dbs[db])}


# --- a small filesystem ---------------------------------------------------------------------------------

@contextlib.contextmanager
def small_filesystem(mountpoint: Path, size_mib: int) -> Iterator[str]:
    """Mounts a filesystem of `size_mib` MiB on `mountpoint`: tmpfs, else an ext4 loop file. Yields its kind.

    The tests run as root; where neither mount works they fail, unless KVTIERD_SKIP_MOUNT=1 skips them."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    image = mountpoint.parent / f".{mountpoint.name}.img"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(mountpoint)],
                          capture_output=True, text=True)
    kind, errors = ("tmpfs" if done.returncode == 0 else None), [f"tmpfs: {done.stderr.strip()}"]
    if kind is None:
        try:
            with open(image, "wb") as f:
                f.truncate(size_mib << 20)
            subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True, text=True)
            done = subprocess.run(["mount", "-o", "loop", str(image), str(mountpoint)], capture_output=True, text=True)
            kind = "ext4 loop file" if done.returncode == 0 else None
            errors.append(f"loop: {done.stderr.strip()}")
        except (OSError, subprocess.CalledProcessError) as e:
            errors.append(f"loop: {e}")
    if kind is None:
        image.unlink(missing_ok=True)
        message = f"cannot mount a small filesystem on {mountpoint} ({'; '.join(errors)})"
        if os.environ.get("KVTIERD_SKIP_MOUNT") == "1":
            pytest.skip(message)
        pytest.fail(message + "; run the tests as root, or set KVTIERD_SKIP_MOUNT=1 to skip")
    try:
        yield kind
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
        image.unlink(missing_ok=True)


# --- figures -----------------------------------------------------------------------------------------

def report(capsys: pytest.CaptureFixture, test: str, **figures: object) -> None:
    """Prints what a test measured straight to the terminal, captured output or not."""
    line = ", ".join(f"{name.replace('_', ' ')}: {value}" for name, value in figures.items())
    with capsys.disabled():
        print(f"\n[fault suite] {test}: {line}", flush=True)


def remove_root(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
