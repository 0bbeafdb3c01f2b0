"""Tenants across instances: two kvtierd daemons (CPU) behind a real nginx with the shipped
deploy/nginx/kvtierd-placement.conf, and per-tenant limits on them.

Both daemons read one placement (alice on gpu0, bob on gpu1); carol is placed nowhere, so her
conversations hash over both. nginx's config is the shipped one with its sockets, port and map files
moved (as test_nginx.py does for kvtierd.conf). The instance-stopped test runs last: it stops gpu1.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from daemon_fixtures import Daemon, start_daemon, wait_ready
from waiting import wait_until
from test_nginx import NGINX, free_port, main_config, wait_listening, worker_identity

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "deploy" / "nginx" / "kvtierd-placement.conf"
KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-2", "carol": "sk-carol-3"}
PLACEMENT = {"alice": "gpu0", "bob": "gpu1"}
LIMITS = "limited=sessions:2 inflight:1"
HI = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}


@dataclass
class Fleet:
    api: str
    gpu0: Daemon
    gpu1: Daemon

    def client(self, who: str, **headers: str) -> httpx.Client:
        return httpx.Client(base_url=self.api, headers={"Authorization": f"Bearer {KEYS[who]}", **headers},
                            timeout=120)


def site_config(socks: dict[str, Path], port: int, keys: Path, placement: Path) -> str:
    text = SHIPPED.read_text()
    for old, new in (("unix:/run/kvtierd/gpu0.sock;", f"unix:{socks['gpu0']};"),
                     ("unix:/run/kvtierd/gpu1.sock;", f"unix:{socks['gpu1']};"),
                     ("listen 8000;", f"listen 127.0.0.1:{port};"),
                     ("include /etc/nginx/kvtierd-keys.map;", f"include {keys};"),
                     ("include /etc/nginx/kvtierd-placement.map;", f"include {placement};")):
        assert text.count(old) >= 1, old
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    if not NGINX.exists():
        pytest.fail(f"{NGINX} not found: `make system-deps` installs it (Debian package nginx)")
    user, group = worker_identity()
    base = Path(tempfile.mkdtemp(prefix="kvtp-"))
    base.chmod(0o755)
    shared = {"KVTIERD_ADMIN_GROUP": group, "KVTIERD_SOCKET_GROUP": group, "KVTIERD_KV_CACHE_BYTES": "64MiB",
              "KVTIERD_PLACEMENT": ",".join(f"{t}={i}" for t, i in PLACEMENT.items()),
              "KVTIERD_TENANT_LIMITS": LIMITS}
    daemons = {name: start_daemon(base / name, env={**shared, "KVTIERD_INSTANCE": name}, wait=False)
               for name in ("gpu0", "gpu1")}
    nginx = None
    try:
        for name, d in daemons.items():
            wait_ready(d)
            (base / name).chmod(0o755)
        prefix = base / "nginx"
        (prefix / "tmp").mkdir(parents=True)
        keys, placement = prefix / "keys.map", prefix / "placement.map"
        keys.write_text("".join(f'"Bearer {key}" {name};\n' for name, key in KEYS.items()))
        placement.write_text("".join(f"{t} kvtierd_{i};\n" for t, i in PLACEMENT.items()))
        port = free_port()
        (prefix / "kvtierd.conf").write_text(site_config({n: d.socket for n, d in daemons.items()}, port, keys,
                                                         placement))
        conf = prefix / "nginx.conf"
        conf.write_text(main_config(prefix, user, group))
        argv = [str(NGINX), "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
        checked = subprocess.run([*argv, "-t"], capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr
        nginx = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(nginx, port, prefix / "error.log")
        yield Fleet(f"http://127.0.0.1:{port}", daemons["gpu0"], daemons["gpu1"])
    finally:
        if nginx is not None:
            nginx.send_signal(signal.SIGQUIT)
            try:
                nginx.wait(30)
            except subprocess.TimeoutExpired:
                nginx.kill()
        for d in daemons.values():
            d.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_placed_tenant_always_reaches_its_instance(fleet: Fleet):
    for who, instance in PLACEMENT.items():
        with fleet.client(who) as c:
            for _ in range(3):
                r = c.post("/v1/chat/completions", json=HI, headers={"X-Session-Id": uuid.uuid4().hex})
                assert r.status_code == 200, r.text
                assert r.headers["X-Kvtierd-Instance"] == instance


def test_a_conversations_turns_land_on_one_instance(fleet: Fleet):
    seen = set()
    with fleet.client("carol") as c:
        for i in range(12):
            sid = f"conv-{i}"
            made = c.post("/v1/sessions", json={"id": sid}, headers={"X-Session-Id": sid})
            assert made.status_code == 201, made.text
            home = made.headers["X-Kvtierd-Instance"]
            seen.add(home)
            got = c.get(f"/v1/sessions/{sid}")  # routed by the session in the path: the same instance
            assert got.status_code == 200 and got.headers["X-Kvtierd-Instance"] == home
            if i < 2:  # a real turn, as the frontend sends it
                turn = c.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "max_tokens": 2})
                assert turn.status_code == 200 and turn.headers["X-Kvtierd-Instance"] == home
    assert seen == {"gpu0", "gpu1"}  # 12 conversations spread over both (one-sided: p = 2 / 4096)


def test_a_misrouted_request_is_told_where_its_tenant_belongs(fleet: Fleet):
    with fleet.gpu0.client(**{"X-Kvtierd-Tenant": "bob"}) as c:
        r = c.post("/v1/chat/completions", json=HI)
    assert r.status_code == 421
    error = r.json()["error"]
    assert error["code"] == "tenant_placed_elsewhere" and "'gpu1'" in error["message"]
    with fleet.gpu0.client() as c:
        assert c.get("/healthz").status_code == 200  # admin, health and metrics answer whatever the tenant
        status = c.get("/admin/status").json()
    assert status["instance"] == "gpu0" and status["placed_here"] == ["alice"]
    shown = subprocess.run([sys.executable, "-m", "kvtierd.cli.ctl", "--socket", str(fleet.gpu0.socket), "status"],
                           capture_output=True, text=True, timeout=60, env={"COLUMNS": "200", "PATH": "/usr/bin"})
    assert shown.returncode == 0 and "alice" in shown.stdout and "gpu0" in shown.stdout, shown.stderr


def test_past_its_session_limit_a_tenant_gets_429_and_keeps_its_sessions(fleet: Fleet):
    with fleet.gpu0.client(**{"X-Kvtierd-Tenant": "limited"}) as c:
        for sid in ("s1", "s2"):
            assert c.post("/v1/sessions", json={"id": sid}).status_code == 201
        r = c.post("/v1/sessions", json={"id": "s3"})
        assert r.status_code == 429
        error = r.json()["error"]
        assert error["code"] == "tenant_sessions_limit" and "2 stored sessions" in error["message"]
        r = c.post("/v1/chat/completions", json={**HI, "session_id": "s4"})  # created on first use: refused too
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_sessions_limit"
        assert sorted(s["id"] for s in c.get("/v1/sessions").json()["data"]) == ["s1", "s2"]
        assert c.post("/v1/sessions/s1/messages", json={"content": "Hi", "max_tokens": 2}).status_code == 200
        assert c.delete("/v1/sessions/s2").status_code in (200, 204)
        assert c.post("/v1/sessions", json={"id": "s3"}).status_code == 201  # room again


def test_past_its_requests_in_flight_a_tenant_gets_429_and_others_do_not(fleet: Fleet):
    story = {"messages": [{"role": "user", "content": "Count from one to one hundred in words, separated by commas."}],
             "stream": True, "max_tokens": 1000, "temperature": 0}  # runs for seconds: still in flight below
    limited = {"X-Kvtierd-Tenant": "limited"}
    with fleet.gpu0.client(**limited) as streaming, fleet.gpu0.client(**limited) as c:
        with streaming.stream("POST", "/v1/chat/completions", json=story) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            with fleet.gpu0.client() as admin:  # the engine runs it: it is in flight
                assert admin.get("/admin/status").json()["engine"]["running"] == 1
            refused = c.post("/v1/chat/completions", json=HI)
            with fleet.gpu0.client(**{"X-Kvtierd-Tenant": "alice"}) as other:
                assert other.post("/v1/chat/completions", json=HI).status_code == 200  # not limited
        # Leaving the stream hangs up: the daemon cancels it, and the tenant has room again.
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "tenant_inflight_limit" and "1 requests in flight" in error["message"]
        assert refused.headers["Retry-After"] == "1"
        wait_until(lambda: c.post("/v1/chat/completions", json=HI).status_code == 200, "the hung-up stream to end",
                   poll_s=0.2)


def test_a_stopped_instance_gives_its_tenants_503_never_another_instance(fleet: Fleet):
    assert fleet.gpu1.stop() == 0
    with fleet.client("bob") as c:
        r = c.post("/v1/chat/completions", json=HI)
    assert r.status_code == 503, r.text  # gpu0 would have answered 421 (bob is placed on gpu1)
    assert r.json()["error"]["code"] == "instance_unavailable" and "X-Kvtierd-Instance" not in r.headers
    with fleet.client("alice") as c:
        assert c.post("/v1/chat/completions", json=HI).status_code == 200  # the other instance serves on
