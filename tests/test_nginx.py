"""kvtierd behind a real nginx (Debian's), with the shipped deploy/nginx/kvtierd.conf.

nginx runs in the foreground from a temporary prefix on loopback ports, its config including the shipped
file with only its socket, ports and key file moved. Run as root, nginx's workers run as www-data with the
daemon's admin and socket group as their group, as the README's setup has it; otherwise they run as us,
and our own group is the admin group. The official openai client talks to nginx with each frontend's key.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from daemon_fixtures import Daemon, start_daemon

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "deploy" / "nginx" / "kvtierd.conf"
NGINX = Path("/usr/sbin/nginx")
KEYS = {"alice": "sk-alice-3f9c2e", "bob": "sk-bob-81d0a7"}
GREEDY = {"temperature": 0, "max_tokens": 8}
HI = [{"role": "user", "content": "Name three colours, one per line."}]


@dataclass(frozen=True)
class Front:
    api: str  # the frontends' base URL
    metrics: str  # Prometheus' base URL
    daemon: Daemon

    def client(self, who: str | None = None, **headers: str) -> httpx.Client:
        auth = {"Authorization": f"Bearer {KEYS[who]}"} if who else {}
        return httpx.Client(base_url=self.api, headers={**auth, **headers}, timeout=120)

    def openai(self, who: str):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.api}/v1", api_key=KEYS[who], timeout=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_identity() -> tuple[str | None, str]:
    """nginx's worker user (None: nginx runs as us) and the group kvtierd trusts it by."""
    if os.geteuid() != 0:
        return None, grp.getgrgid(os.getgid()).gr_name
    user = "www-data"
    pwd.getpwnam(user)  # Debian's nginx package makes it
    return user, grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name


def site_config(sock: Path, api_port: int, metrics_port: int, keys: Path) -> str:
    """The shipped file with its socket, ports and key file moved; everything else as shipped."""
    text = SHIPPED.read_text()
    for old, new in (("unix:/run/kvtierd/kvtierd.sock;", f"unix:{sock};"),
                     ("listen 8000;", f"listen 127.0.0.1:{api_port};"),
                     ("listen 127.0.0.1:9464;", f"listen 127.0.0.1:{metrics_port};"),
                     ("include /etc/nginx/kvtierd-keys.map;", f"include {keys};")):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def main_config(prefix: Path, user: str | None, group: str) -> str:
    temp = "\n".join(f"    {kind}_temp_path {prefix}/tmp/{kind};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
{f"user {user} {group};" if user else ""}
events {{ worker_connections 64; }}
http {{
    access_log {prefix}/access.log;
{temp}
    include {prefix}/kvtierd.conf;
}}
"""


def wait_listening(process: subprocess.Popen, port: int, log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"nginx exited with {process.returncode}:\n{log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"nginx did not listen on {port} in {timeout} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def front() -> Iterator[Front]:
    if not NGINX.exists():
        pytest.fail(f"{NGINX} not found: `make system-deps` installs it (Debian package nginx)")
    user, group = worker_identity()
    base = Path(tempfile.mkdtemp(prefix="kvtn-"))  # short (a socket inside) and open to the workers
    base.chmod(0o755)
    daemon = start_daemon(base / "d", env={"KVTIERD_ADMIN_GROUP": group, "KVTIERD_SOCKET_GROUP": group})
    (base / "d").chmod(0o755)
    prefix = base / "nginx"
    (prefix / "tmp").mkdir(parents=True)
    keys = prefix / "kvtierd-keys.map"
    keys.write_text("".join(f'"Bearer {key}" {name};\n' for name, key in KEYS.items()))
    api_port, metrics_port = free_port(), free_port()
    (prefix / "kvtierd.conf").write_text(site_config(daemon.socket, api_port, metrics_port, keys))
    conf = prefix / "nginx.conf"
    conf.write_text(main_config(prefix, user, group))
    argv = [str(NGINX), "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
    checked = subprocess.run([*argv, "-t"], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr
    log = prefix / "error.log"
    nginx = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(nginx, api_port, log)
        wait_listening(nginx, metrics_port, log)
        yield Front(f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{metrics_port}", daemon)
    finally:
        nginx.send_signal(signal.SIGQUIT)  # graceful: workers finish, then the master exits
        try:
            nginx.wait(30)
        except subprocess.TimeoutExpired:
            nginx.kill()
        assert daemon.stop() == 0, daemon.log_text()
        shutil.rmtree(base, ignore_errors=True)


def test_the_openai_client_through_nginx_streamed_and_whole(front: Front):
    with front.openai("alice") as client:
        whole = client.chat.completions.create(model="default", messages=HI, **GREEDY)
        assert whole.choices[0].message.content and whole.usage.completion_tokens == GREEDY["max_tokens"]
        chunks = list(client.chat.completions.create(model="default", messages=HI, stream=True,
                                                     stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == GREEDY["max_tokens"]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # token by token, not one lump


def test_the_stream_arrives_while_the_reply_is_generated(front: Front):
    """SSE passes unbuffered: the first token is out while kvtierd still generates the rest."""
    body = {"messages": [{"role": "user", "content": "Count from one to fifty in words."}], "stream": True,
            "temperature": 0, "max_tokens": 48}
    with front.client("alice") as http, front.daemon.client() as direct:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            first = next(line for line in lines if token_text(line))
            streaming = direct.get("/metrics").text
            rest = [line for line in lines if line]
    assert "kvtierd_http_active_streams 1.0" in streaming, first
    assert rest[-1] == "data: [DONE]" and sum(1 for line in rest if token_text(line)) > 1


def token_text(line: str) -> str:
    """The text of an SSE line's chat chunk ("" for anything else)."""
    if not line.startswith("data: {"):
        return ""
    choices = json.loads(line.removeprefix("data: "))["choices"]
    return choices[0]["delta"].get("content", "") if choices else ""


def test_two_keys_are_two_tenants_kept_apart(front: Front):
    with front.client("alice") as alice, front.client("bob") as bob:
        made = alice.post("/v1/sessions", json={"id": "web-chat-1", "system_prompt": "Be brief."})
        assert made.status_code == 201 and made.json()["tenant"] == "alice"
        assert bob.get("/v1/sessions/web-chat-1").status_code == 404
        assert "web-chat-1" not in {s["id"] for s in bob.get("/v1/sessions").json()["data"]}
        # bob's frontend picked the same id: bob's own conversation, created on first use
        r = bob.post("/v1/chat/completions", json={"messages": HI, "session_id": "web-chat-1", **GREEDY})
        assert r.status_code == 200, r.text
        assert bob.get("/v1/sessions/web-chat-1").json()["tenant"] == "bob"
        assert alice.get("/v1/sessions/web-chat-1").json()["messages"] == []


@pytest.mark.parametrize("header", ["X-Kvtierd-Tenant", "x-kvtierd-tenant"])
def test_a_client_naming_a_tenant_gets_its_own(front: Front, header: str):
    with front.client("alice", **{header: "bob"}) as alice, front.client("bob") as bob:
        made = alice.post("/v1/sessions", json={})
        assert made.status_code == 201 and made.json()["tenant"] == "alice"
        assert bob.get(f"/v1/sessions/{made.json()['id']}").status_code == 404


@pytest.mark.parametrize("authorization", [None, "Bearer sk-nobody", f"Basic {KEYS['alice']}", KEYS["alice"]])
def test_no_key_or_an_unknown_key_is_401(front: Front, authorization: str | None):
    headers = {} if authorization is None else {"Authorization": authorization}
    with httpx.Client(base_url=front.api, headers=headers) as http:
        r = http.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/admin/status", "/admin/sessions", "/v1/../admin/status", "/v1/%2e%2e/admin/status",
                                  "/v1/x/..%2f..%2fadmin/status", "/metrics", "/healthz", "/openapi.json"])
def test_only_the_api_is_public(front: Front, path: str):
    """As sent, byte for byte: an HTTP client library would tidy the dot segments away first."""
    port = int(front.api.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['alice']}\r\n"
                  "Connection: close\r\n\r\n".encode())
        response = b""
        while chunk := s.recv(65536):
            response += chunk
    head, _, body = response.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 404"), head
    assert "engine" not in body and "kvtierd_" not in body


def test_metrics_alone_on_the_metrics_port(front: Front):
    with httpx.Client(base_url=front.metrics) as http:
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and "# TYPE kvtierd_requests_total counter" in metrics.text
        for path in ("/admin/status", "/v1/models", "/healthz", "/metrics/x"):
            assert http.get(path).status_code == 404, path
