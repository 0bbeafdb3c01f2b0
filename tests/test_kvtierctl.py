"""kvtierctl, run as a subprocess: no daemon, a stale socket, a forbidden socket, and a fake daemon.

The fake daemon is a real aiohttp server on a Unix socket, in a thread of this process,
serving the admin routes' JSON contract from canned bodies; the thing under test is the CLI.
Every failure must be one `error: ...` line on stderr, a non-zero exit, and no traceback.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest

from kvtierd.cli.admin_client import connection_error, default_socket_path, resolve_socket_path

web = pytest.importorskip("aiohttp.web")

ROOT = Path(__file__).resolve().parents[1]
NOW = datetime.now(timezone.utc)
SESSION_ID = "sess-aaaa1111"

STATUS = {
    "version": "0.1.0-test",
    "uptime_s": 7530.0,
    "socket": "/run/kvtierd/kvtierd.sock",
    "state_dir": "/var/lib/kvtierd",
    "model": {
        "name": "SmolLM2-135M-Instruct",
        "fingerprint": "md5:3f2a9c0e",
        "architecture": "llama",
        "num_layers": 30,
        "device": "cuda:0",
        "dtype": "int8",
        "kv_dtype": "bfloat16",
        "context_window": 8192,
    },
    "engine": {
        "attention_backend": "cupy-paged",
        "matmul_backend": "torch",
        "running": 3,
        "waiting": 7,
        "block_size": 16,
        "num_blocks": 4000,
        "free_blocks": 1000,
        "cached_blocks": 1000,
        "used_blocks": 2000,
    },
    "draining": False,
}
TIERS = {
    "tiers": [
        {
            "name": "device",
            "capacity_bytes": 8 << 30,
            "used_bytes": 2 << 30,
            "pages_total": 4000,
            "pages_used": 2000,
            "pages_cached": 1000,
            "pages_free": 1000,
            "query_tokens": 29000,
            "hit_tokens": 12345,
            "hit_rate": 0.425,
        },
        {
            "name": "disk",
            "capacity_bytes": 512 << 20,
            "used_bytes": 0,
            "pages_total": 2048,
            "pages_used": 0,
            "pages_cached": 0,
            "pages_free": 2048,
            "query_tokens": 0,
            "hit_tokens": 0,
            "hit_rate": 0.0,
            "codec": "zstd-planes",
            "reconciled": {"orphan_values": 3, "orphan_rows": 1},
        },
    ]
}
SESSION = {
    "id": SESSION_ID,
    "tenant": "acme",
    "qos_class": "interactive",
    "title": "Trip [planning]",  # brackets: rich must not read them as markup
    "created_at": (NOW - timedelta(hours=3, minutes=10, seconds=30)).isoformat(),
    "last_used_at": (NOW - timedelta(minutes=45, seconds=30)).isoformat(),
    "token_count": 1536,
    "pinned": True,
    "num_messages": 2,
}
SESSIONS = {"sessions": [SESSION]}
SESSION_DETAIL = {
    "session": SESSION,
    "messages": [
        {
            "seq": 1,
            "role": "user",
            "content": "How far is Lyon from Paris?",
            "status": "done",
            "created_at": SESSION["created_at"],
            "prompt_tokens": None,
            "completion_tokens": None,
        },
        {
            "seq": 2,
            "role": "assistant",
            "content": "About 465 km.",
            "status": "done",
            "created_at": SESSION["last_used_at"],
            "prompt_tokens": 42,
            "completion_tokens": 7,
        },
    ],
}
DELETED = {"deleted": True, "freed_blocks": 12}
PREFIXES = {
    "prefixes": [
        {
            "hash": "9f86d081884c7d659a2feaa0c55ad015",
            "tenant": "acme",
            "num_tokens": 256,
            "pages": 16,
            "hits": 17,
            "first_page_hits": 40,
            "last_hit_s_ago": 12.5,
            "in_use": True,
            "tier": "device",
            "pinned": False,
            "tags": ["doc:v3"],
            "preview": "<|im_start|>system\nYou are",
        }
    ]
}
STATS = {
    "requests": 1234,
    "prompt_tokens": 100000,
    "cached_tokens": 25000,
    "generated_tokens": 5555,
    "preemptions": 3,
    "errors_4xx": 2,
    "errors_5xx": 0,
    "active_streams": 1,
}
PINS = {"pins": [], "budget": {"share": 0.25, "device_pages": 0, "device_limit_pages": 1000}}
CANNED = {
    ("GET", "/admin/status"): STATUS,
    ("GET", "/admin/pins"): PINS,
    ("GET", "/admin/tiers"): TIERS,
    ("GET", "/admin/sessions"): SESSIONS,
    ("GET", f"/admin/sessions/{SESSION_ID}"): SESSION_DETAIL,
    ("DELETE", f"/admin/sessions/{SESSION_ID}"): DELETED,
    ("GET", "/admin/prefixes"): PREFIXES,
    ("GET", "/admin/stats"): STATS,
}


def openai_error(message: str, type_: str, code: str) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


class FakeDaemon:
    """aiohttp on a UnixSite in a background thread; `overrides` replace canned answers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.overrides: dict[tuple[str, str], web.Response] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-kvtierd", daemon=True)

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.UnixSite(self.runner, str(self.path)).start()

    async def _handle(self, request: web.Request) -> web.Response:
        key = (request.method, request.path)
        self.requests.append((request.method, request.path, dict(request.query)))
        if key in self.overrides:
            return self.overrides[key]
        if key in CANNED:
            return web.json_response(CANNED[key])
        return web.json_response(openai_error(f"no route {request.path}", "invalid_request_error", "not_found"), status=404)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> FakeDaemon:
    fake = FakeDaemon(tmp_path_factory.mktemp("ctl") / "kvtierd.sock")
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def fake(daemon: FakeDaemon) -> FakeDaemon:
    daemon.overrides.clear()
    daemon.requests.clear()
    return daemon


def ctl_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVTIERD_SOCKET"}
    # Wide enough that rich never wraps a value the tests look for.
    env.update(COLUMNS="200", PYTHONIOENCODING="utf-8", **extra)
    return env


def kvtierctl(*args: str, socket_path: Path | None = None, prefix: list[str] | None = None, python: str = sys.executable, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [*(prefix or []), python, "-m", "kvtierd.cli.ctl"]
    if socket_path is not None:
        argv += ["--socket", str(socket_path)]
    return subprocess.run(
        [*argv, *args], capture_output=True, text=True, encoding="utf-8", env=env or ctl_env(), timeout=60, cwd=ROOT
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], exit_code: int, *fragments: str) -> None:
    assert result.returncode == exit_code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""


# ---- no daemon -------------------------------------------------------------------------


def test_missing_socket_says_so_and_exits_2(tmp_path: Path):
    path = tmp_path / "absent.sock"
    result = kvtierctl("status", env=ctl_env(KVTIERD_SOCKET=str(path)))
    assert_one_error_line(
        result, 2, f"no kvtierd socket at {path} (is the daemon running? set --socket or KVTIERD_SOCKET)"
    )


def test_stale_socket_file_is_connection_refused(tmp_path: Path):
    path = tmp_path / "stale.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # the file stays, nothing listens
    assert_one_error_line(kvtierctl("tiers", socket_path=path), 2, f"nothing is listening on {path}")


def _python_for_nobody() -> tuple[str, dict[str, str]] | None:
    """An interpreter `nobody` can run that imports this checkout, or None.

    The venv's python links into root's home, which nobody cannot enter; a system
    python of the same version can use this checkout and the venv's pure-Python packages.
    """
    env = ctl_env(PYTHONPATH=os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]]))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable, shutil.which(version, path="/usr/bin:/usr/local/bin") or ""]
    for python in filter(None, candidates):
        probe = subprocess.run(
            ["runuser", "-u", "nobody", "--", python, "-c", "import kvtierd.cli.ctl"],
            capture_output=True, env=env, timeout=60, cwd="/",
        )
        if probe.returncode == 0:
            return python, env
    return None


@pytest.mark.skipif(shutil.which("runuser") is None, reason="runuser is missing: cannot run the CLI as another user")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a socket that nobody may not open")
def test_socket_nobody_may_not_open_says_permission_denied():
    found = _python_for_nobody()
    if found is None:
        pytest.skip("user nobody cannot run a Python that imports kvtierd here")
    python, env = found
    folder = Path(tempfile.mkdtemp(prefix="kvtierctl-perm-"))
    try:
        folder.chmod(0o755)  # nobody may enter the folder, just not open the socket
        path = folder / "kvtierd.sock"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen()
        path.chmod(0o600)
        try:
            result = kvtierctl("stats", socket_path=path, prefix=["runuser", "-u", "nobody", "--"], python=python, env=env)
        finally:
            server.close()
    finally:
        shutil.rmtree(folder)
    assert_one_error_line(result, 2, f"permission denied on {path} (join the socket's group or use sudo)")


def test_permission_error_maps_to_one_line_hint():
    # What httpx raises: its ConnectError, caused by httpcore's, caused by the OSError.
    cause = PermissionError(errno.EACCES, "Permission denied")
    try:
        try:
            raise cause
        except PermissionError as e:
            raise httpx.ConnectError("[Errno 13] Permission denied") from e
    except httpx.ConnectError as e:
        problem = connection_error(e, Path("/run/kvtierd/kvtierd.sock"))
    assert problem.exit_code == 2
    assert problem.message == "permission denied on /run/kvtierd/kvtierd.sock (join the socket's group or use sudo)"


def test_default_socket_path_follows_the_runtime_dirs():
    assert default_socket_path({"RUNTIME_DIRECTORY": "/run/kvtierd", "XDG_RUNTIME_DIR": "/run/user/7"}) == Path(
        "/run/kvtierd/kvtierd.sock"
    )
    assert default_socket_path({"RUNTIME_DIRECTORY": "/run/a:/run/b"}) == Path("/run/a/kvtierd.sock")
    assert default_socket_path({"XDG_RUNTIME_DIR": "/run/user/7"}) == Path("/run/user/7/kvtierd/kvtierd.sock")
    assert default_socket_path({"RUNTIME_DIRECTORY": ""}) == Path(f"/tmp/kvtierd-{os.getuid()}/kvtierd.sock")
    env = {"KVTIERD_SOCKET": "/srv/k.sock", "XDG_RUNTIME_DIR": "/run/user/7"}
    assert resolve_socket_path("/flag.sock", env) == Path("/flag.sock")
    assert resolve_socket_path(None, env) == Path("/srv/k.sock")
    assert resolve_socket_path(None, {"XDG_RUNTIME_DIR": "/run/user/7"}) == Path("/run/user/7/kvtierd/kvtierd.sock")


# ---- fake daemon: tables ---------------------------------------------------------------


def table_of(fake: FakeDaemon, *args: str) -> str:
    result = kvtierctl(*args, socket_path=fake.path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def test_status_table(fake: FakeDaemon):
    out = table_of(fake, "status")
    for value in (
        "0.1.0-test", "serving", "2h 05m", "/var/lib/kvtierd", "SmolLM2-135M-Instruct", "md5:3f2a9c0e",
        "llama, 30 layers", "cuda:0 / int8 / bfloat16", "8,192 tokens", "cupy-paged", "3 running, 7 waiting",
        "16 tokens", "4,000 total", "2,000 (50.0%)", "1,000 (25.0%)",
    ):
        assert value in out, value


def test_tiers_table(fake: FakeDaemon):
    out = table_of(fake, "tiers")
    for value in ("device", "2.0 GiB", "25.0%", "8.0 GiB", "42.5%", "12,345", "29,000", "disk", "512.0 MiB", "2,048",
                  "zstd-planes", "3 / 1"):
        assert value in out, value


def test_stats_table(fake: FakeDaemon):
    out = table_of(fake, "stats")
    for value in ("1,234", "100,000", "25,000 (25.0% of prompt)", "5,555", "Preemptions", "Active streams"):
        assert value in out, value


def test_sessions_ls_table_passes_filters(fake: FakeDaemon):
    out = table_of(fake, "sessions", "ls", "--tenant", "acme", "--limit", "5")
    for value in (SESSION_ID, "acme", "interactive", "Trip [planning]", "1,536", "yes", "m "):
        assert value in out, value
    assert fake.requests == [("GET", "/admin/sessions", {"tenant": "acme", "limit": "5"})]


def test_sessions_show_table(fake: FakeDaemon):
    out = table_of(fake, "sessions", "show", SESSION_ID)
    for value in (SESSION_ID, "Trip [planning]", "How far is Lyon from Paris?", "About 465 km.", "assistant", "42", "tenant acme"):
        assert value in out, value


def test_sessions_rm_deletes(fake: FakeDaemon):
    out = table_of(fake, "sessions", "rm", SESSION_ID)
    assert out.strip() == f"deleted session {SESSION_ID} (freed 12 blocks)"
    assert fake.requests == [("DELETE", f"/admin/sessions/{SESSION_ID}", {})]


def test_prefixes_table(fake: FakeDaemon):
    out = table_of(fake, "prefixes", "ls", "--limit", "3")
    for value in ("9f86d081884c7d65", "acme", "256", "17", "40", "12s ago", "device*", "doc:v3", "<|im_start|>system"):
        assert value in out, value
    assert fake.requests == [("GET", "/admin/prefixes", {"limit": "3"})]


# ---- fake daemon: --json and errors ----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "route"),
    [
        (["status"], ("GET", "/admin/status")),
        (["tiers"], ("GET", "/admin/tiers")),
        (["stats"], ("GET", "/admin/stats")),
        (["sessions", "ls"], ("GET", "/admin/sessions")),
        (["sessions", "show", SESSION_ID], ("GET", f"/admin/sessions/{SESSION_ID}")),
        (["sessions", "rm", SESSION_ID], ("DELETE", f"/admin/sessions/{SESSION_ID}")),
        (["prefixes", "ls"], ("GET", "/admin/prefixes")),
    ],
)
def test_json_prints_what_the_daemon_sent(fake: FakeDaemon, args: list[str], route: tuple[str, str]):
    result = kvtierctl("--json", *args, socket_path=fake.path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == CANNED[route]


@pytest.mark.parametrize(
    ("args", "route"),
    [
        (["status", "--json"], ("GET", "/admin/status")),
        (["pins", "--json"], ("GET", "/admin/pins")),
        (["sessions", "ls", "--json"], ("GET", "/admin/sessions")),
        (["sessions", "show", "--json", SESSION_ID], ("GET", f"/admin/sessions/{SESSION_ID}")),
    ],
)
def test_json_after_the_command_works_as_before_it(fake: FakeDaemon, args: list[str], route: tuple[str, str]):
    result = kvtierctl(*args, socket_path=fake.path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == CANNED[route]


def test_json_after_a_double_dash_is_an_argument(fake: FakeDaemon):
    result = kvtierctl("sessions", "show", "--", "--json", socket_path=fake.path)
    assert_one_error_line(result, 1, "--json")
    assert fake.requests[-1][:2] == ("GET", "/admin/sessions/--json")


def test_forbidden_prints_the_daemons_message_and_exits_1(fake: FakeDaemon):
    message = "admin routes need root or the kvtierd-admin group"
    fake.overrides[("GET", "/admin/status")] = web.json_response(
        openai_error(message, "permission_error", "forbidden"), status=403
    )
    result = kvtierctl("status", socket_path=fake.path)
    assert_one_error_line(result, 1)
    assert result.stderr == f"error: {message}\n"


def test_unknown_session_is_a_daemon_error(fake: FakeDaemon):
    assert_one_error_line(kvtierctl("sessions", "show", "nope", socket_path=fake.path), 1, "no route /admin/sessions/nope")


def test_error_status_without_json_body_exits_1(fake: FakeDaemon):
    fake.overrides[("GET", "/admin/stats")] = web.Response(status=500, text="<html>\n<h1>boom</h1>\n</html>", content_type="text/html")
    assert_one_error_line(kvtierctl("stats", socket_path=fake.path), 1, "kvtierd answered 500 Internal Server Error")


def test_non_json_answer_is_one_clear_line(fake: FakeDaemon):
    fake.overrides[("GET", "/admin/tiers")] = web.Response(text="<html>hello</html>", content_type="text/html")
    assert_one_error_line(kvtierctl("tiers", socket_path=fake.path), 2, "GET /admin/tiers", "is not JSON")


def test_answer_of_the_wrong_shape_is_one_clear_line(fake: FakeDaemon):
    fake.overrides[("GET", "/admin/status")] = web.json_response({"version": "9.9"})
    assert_one_error_line(kvtierctl("status", socket_path=fake.path), 2, "unexpected answer from kvtierd")
