"""Bad input gets a clear error and costs nothing; the daemon's socket and shutdown.

Against real `kvtierd serve` processes over their Unix sockets. Every refusal is
OpenAI-shaped JSON (`{"error": {"message", "type", "param", "code"}}`) with one
4xx status; afterwards the daemon is still up, holds no KV page and has answered
no 5xx. Clients that hang up lose their request, never the daemon's pages or a
session's consistency. The lifecycle tests start daemons of their own under short
/tmp paths (a Unix socket path is limited to ~107 bytes).
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from daemon_fixtures import Daemon, engine_status, start_daemon, wait_idle
from waiting import HANG_GUARD_S, wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TENANT = "X-Kvtierd-Tenant"  # settings.tenant_header's default
HI = [{"role": "user", "content": "Say hi."}]
STORY = [{"role": "user", "content": "Count from one to one hundred in words, separated by commas."}]
LONG_REPLY = 2000  # STORY's greedy reply runs past 600 tokens without an EOS: seconds of decoding, even on a GPU


def chat(**fields: object) -> dict:
    """A valid, tiny chat body, with `fields` put over it (None removes one)."""
    body = {"messages": HI, "max_tokens": 2, "temperature": 0, **fields}
    return {k: v for k, v in body.items() if v is not None}


def tenant(name: str) -> dict[str, str]:
    """Headers naming a tenant unique to this run (tests run as root, an admin, so they may)."""
    return {TENANT: f"{name}-{uuid.uuid4().hex[:8]}"}


def assert_error(r: httpx.Response, status: int, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> str:
    """The response is an OpenAI-shaped error with this status; returns its message."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == type, error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error["message"]




def raw_post(sock_path: Path, path: str, body: dict) -> socket.socket:
    """Sends one HTTP/1.1 POST on a fresh connection and returns the socket, unread."""
    data = json.dumps(body).encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(str(sock_path))
    head = f"POST {path} HTTP/1.1\r\nHost: kvtierd\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    s.sendall(head.encode() + data)
    return s


@pytest.fixture
def api(daemon: Daemon) -> Iterator[httpx.Client]:
    """A client of the shared daemon; afterwards the daemon must be up and idle, with no new 5xx."""
    with daemon.client() as c:
        errors_5xx = c.get("/admin/stats").json()["errors_5xx"]
        yield c
        wait_idle(c)
        assert c.get("/admin/stats").json()["errors_5xx"] == errors_5xx, daemon.log_text()[-4000:]
    assert daemon.process.poll() is None, daemon.log_text()[-4000:]


@pytest.fixture
def session_id(api: httpx.Client) -> str:
    r = api.post("/v1/sessions", json={"title": "errors"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


# --- bodies that are not a JSON object --------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    pytest.param(b"{bad", id="malformed"),
    pytest.param(b"", id="empty"),
    pytest.param(b'{"messages": [{"role": "user", "content": "\xff"}]}', id="not-utf8"),
    pytest.param(b"[" * 100_000, id="nested-too-deep"),
    pytest.param(b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', id="lone-surrogate"),
])
def test_body_that_is_not_json_is_refused(api, raw):
    assert_error(api.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400, code="invalid_json")


@pytest.mark.parametrize("body", [[HI], "hello", 42, None], ids=["array", "string", "number", "null"])
def test_body_that_is_not_an_object_is_refused(api, body):
    message = assert_error(api.post(CHAT, content=json.dumps(body)), 400)
    assert "object" in message


# --- fields of the wrong type or out of range --------------------------------------------------------

BAD_CHAT_FIELDS = [
    ("messages-not-a-list", {"messages": {"role": "user", "content": "hi"}}, "messages"),
    ("messages-empty", {"messages": []}, "messages"),
    ("message-not-an-object", {"messages": ["hi"]}, "messages[0]"),
    ("message-without-role", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("role-tool", {"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
    ("content-a-number", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("content-image-part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("max_tokens-a-string", {"max_tokens": "10"}, "max_tokens"),
    ("max_tokens-true", {"max_tokens": True}, "max_tokens"),
    ("max_tokens-a-float", {"max_tokens": 1.0}, "max_tokens"),
    ("max_tokens-0", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens-negative", {"max_tokens": -1}, "max_tokens"),
    ("max_completion_tokens-0", {"max_completion_tokens": 0}, "max_tokens"),
    ("temperature-hot", {"temperature": "hot"}, "temperature"),
    ("temperature-3", {"temperature": 3}, "temperature"),
    ("top_p-0", {"top_p": 0}, "top_p"),
    ("top_k-negative", {"top_k": -1}, "top_k"),
    ("stream-yes", {"stream": "yes"}, "stream"),
    ("stream_options-without-stream", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("stop-5-strings", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("stop-a-number", {"stop": [1]}, "stop"),
    ("stop-empty", {"stop": [""]}, "stop"),
    ("n-2", {"n": 2}, "n"),
    ("top_logprobs-without-logprobs", {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ("top_logprobs-21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("seed-1.5", {"seed": 1.5}, "seed"),
    ("seed-past-64-bits", {"seed": 2**64}, "seed"),
    ("priority-urgent", {"priority": "urgent"}, "priority"),
    ("retention-a-number", {"retention": 5}, "retention"),
    ("retention-priority-11", {"retention": {"priority": 11, "duration_s": 60}}, "retention"),
    ("retention-forever", {"retention": {"priority": 3, "duration_s": 1e9}}, "retention"),
    ("retention-no-duration", {"retention": {"priority": 3}}, "retention"),
    ("frequency_penalty", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("presence_penalty", {"presence_penalty": -1}, "presence_penalty"),
    ("model-a-number", {"model": 5}, "model"),
    ("session_id-a-number", {"session_id": 5}, "session_id"),
    ("user-a-number", {"user": 5}, "user"),
]


@pytest.mark.parametrize("fields,param", [pytest.param(f, p, id=i) for i, f, p in BAD_CHAT_FIELDS])
def test_bad_chat_field_is_refused_naming_it(api, fields, param):
    assert_error(api.post(CHAT, json=chat(**fields)), 400, param=param)


def test_streamed_request_is_refused_before_the_stream_starts(api):
    r = api.post(CHAT, json=chat(stream=True, temperature=3))
    assert_error(r, 400, param="temperature")


def test_unknown_field_is_refused_by_name(api):
    assert_error(api.post(CHAT, json=chat(max_token=5)), 400, param="max_token", code="unknown_field")


# --- too long for the model or the cache --------------------------------------------------------------

def test_prompt_longer_than_the_context_window_is_refused(api):
    window = api.get("/admin/status").json()["model"]["context_window"]
    assert window == 8192  # the bundled SmolLM2-135M-Instruct
    long = [{"role": "user", "content": "hello " * 9000}]  # ~9,000 tokens
    message = assert_error(api.post(CHAT, json=chat(messages=long)), 400, param="messages")
    assert "context window" in message and "8192" in message


def test_max_tokens_past_the_context_window_is_refused(api):
    message = assert_error(api.post(CHAT, json=chat(max_tokens=9000)), 400, param="max_tokens")
    assert "context window" in message


def test_request_that_can_never_fit_the_kv_cache_is_refused(api):
    status = api.get("/admin/status").json()
    capacity = status["engine"]["num_blocks"] * status["engine"]["block_size"]
    assert capacity + 100 < status["model"]["context_window"], "the test daemon's KV pool must be smaller than a window"
    message = assert_error(api.post(CHAT, json=chat(max_tokens=capacity)), 400, param="max_tokens")
    assert "KV cache" in message


def test_body_over_the_size_limit_gets_413(api):
    r = api.post(CHAT, json=chat(user="x" * (4 << 20)))  # the default limit is 4 MiB
    assert_error(r, 413, code="request_too_large")


# --- names that do not exist ---------------------------------------------------------------------------

def test_unknown_model_is_404(api):
    assert_error(api.post(CHAT, json=chat(model="gpt-4")), 404, param="model", code="model_not_found")
    assert_error(api.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1, "model": "gpt-4"}), 404,
                 param="model", code="model_not_found")


def test_unknown_route_is_404_json(api):
    assert_error(api.get("/v1/nothing-here"), 404)


@pytest.mark.parametrize("method,path", [("GET", CHAT), ("DELETE", "/v1/models"), ("PUT", "/v1/sessions")])
def test_wrong_method_is_405_json_saying_what_is_allowed(api, method, path):
    r = api.request(method, path)
    assert_error(r, 405)
    assert r.headers.get("allow"), r.headers


# --- /v1/completions ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,param", [
    pytest.param({"prompt": ""}, "prompt", id="empty-prompt"),
    pytest.param({"prompt": []}, "prompt", id="empty-id-list"),
    pytest.param({}, "prompt", id="no-prompt"),
    pytest.param({"prompt": [10**9]}, "prompt", id="id-past-the-vocabulary"),
    pytest.param({"prompt": [-1]}, "prompt", id="negative-id"),
    pytest.param({"prompt": ["a", "b"]}, "prompt", id="two-prompts"),
    pytest.param({"prompt": "Hi", "echo": True}, "echo", id="echo"),
    pytest.param({"prompt": "Hi", "messages": HI}, "messages", id="chat-field"),
])
def test_bad_completion_is_refused(api, fields, param):
    assert_error(api.post(COMPLETIONS, json={"max_tokens": 1, **fields}), 400, param=param)


# --- sessions --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/sessions/{sid}", None),
    ("DELETE", "/v1/sessions/{sid}", None),
    ("POST", "/v1/sessions/{sid}/messages", {"content": "hi", "max_tokens": 1}),
    ("GET", "/admin/sessions/{sid}", None),
    ("DELETE", "/admin/sessions/{sid}", None),
])
def test_unknown_session_is_404_on_every_route(api, method, path, body):
    sid = f"sess_{uuid.uuid4().hex}"
    body = json.loads(json.dumps(body).replace("{sid}", sid)) if body else None
    assert_error(api.request(method, path.format(sid=sid), json=body), 404, code="session_not_found")


@pytest.mark.parametrize("body,param", [
    pytest.param({"content": ""}, "content", id="empty"),
    pytest.param({}, "content", id="missing"),
    pytest.param({"content": [{"type": "text", "text": "hi"}]}, "content", id="a-list"),
    pytest.param({"content": None}, "content", id="null"),
    pytest.param({"content": "hi", "messages": HI}, "messages", id="unknown-field"),
    pytest.param({"content": "hi", "max_tokens": 0}, "max_tokens", id="max_tokens-0"),
])
def test_bad_session_message_is_refused_and_adds_nothing(api, session_id, body, param):
    assert_error(api.post(f"/v1/sessions/{session_id}/messages", json=body), 400, param=param)
    assert api.get(f"/v1/sessions/{session_id}").json()["messages"] == []


@pytest.mark.parametrize("body,param", [
    pytest.param([], None, id="array"),
    pytest.param({"priority": "urgent"}, "priority", id="priority"),
    pytest.param({"priority": ""}, "priority", id="priority-empty"),  # not the default: a bad value
    pytest.param({"title": 5}, "title", id="title-a-number"),
    pytest.param({"name": "x"}, "name", id="unknown-field"),
])
def test_bad_session_creation_is_refused(api, body, param):
    assert_error(api.post("/v1/sessions", json=body), 400, param=param)


def test_another_tenants_session_is_404(api):
    alice, bob = tenant("alice"), tenant("bob")
    sid = api.post("/v1/sessions", json={}, headers=alice).json()["id"]
    for who in (bob, {}):  # bob, and root as itself
        assert_error(api.get(f"/v1/sessions/{sid}", headers=who), 404, code="session_not_found")
        assert_error(api.post(f"/v1/sessions/{sid}/messages", json={"content": "hi", "max_tokens": 1}, headers=who),
                     404, code="session_not_found")
        assert_error(api.delete(f"/v1/sessions/{sid}", headers=who), 404, code="session_not_found")
    # A chat naming the id starts bob's own session of that id (created on first use), never alice's.
    assert api.post(CHAT, json=chat(session_id=sid), headers=bob).status_code == 200
    assert len(api.get(f"/v1/sessions/{sid}", headers=bob).json()["messages"]) == 2
    mine = api.get(f"/v1/sessions/{sid}", headers=alice)
    assert mine.status_code == 200 and mine.json()["messages"] == []


@pytest.mark.parametrize("name", ["a" * 200, "has space", "a/b", ""], ids=["200-chars", "space", "slash", "empty"])
def test_invalid_tenant_header_is_refused(api, name):
    message = assert_error(api.get("/v1/sessions", headers={TENANT: name}), 400)
    assert TENANT in message


def test_daemon_still_answers_after_bad_input(api):
    stats = api.get("/admin/stats").json()
    assert stats["errors_4xx"] > 0 and stats["errors_5xx"] == 0, stats
    r = api.post(CHAT, json=chat(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                 max_tokens=8))
    assert r.status_code == 200, r.text
    reply = r.json()
    choice = reply["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    assert 1 <= reply["usage"]["completion_tokens"] <= 8


# --- clients that hang up ----------------------------------------------------------------------------------

def test_client_gone_mid_stream_frees_its_pages_and_leaves_no_half_turn(daemon, api, session_id):
    s = raw_post(daemon.socket, CHAT, chat(messages=STORY, max_tokens=200, stream=True, session_id=session_id))
    seen = b""
    while seen.count(b"data: ") < 3:
        chunk = s.recv(4096)
        assert chunk, seen
        seen += chunk
    assert seen.startswith(b"HTTP/1.1 200"), seen
    s.close()
    wait_idle(api)
    messages = api.get(f"/v1/sessions/{session_id}").json()["messages"]
    assert len(messages) in (0, 2), messages  # never a user message without its reply
    if messages:
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert [m["status"] for m in messages] == ["interrupted", "interrupted"]
        assert messages[0]["content"] == STORY[0]["content"]


def test_client_gone_before_a_whole_reply_aborts_it_and_frees_its_pages(daemon, api):
    before = api.get("/admin/stats").json()
    s = raw_post(daemon.socket, CHAT, chat(messages=STORY, max_tokens=LONG_REPLY))
    wait_until(lambda: engine_status(api)["running"], "the request being admitted (it holds pages now)")
    s.close()
    wait_idle(api)
    after = api.get("/admin/stats").json()
    assert after["aborted"] == before["aborted"] + 1  # cancelled, not finished
    assert after["generated_tokens"] - before["generated_tokens"] < LONG_REPLY
    assert api.get("/healthz").status_code == 200


# --- lifecycle: the socket, a second daemon, shutdown ----------------------------------------------------------

@pytest.fixture
def short_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="kvtd-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tuned_daemon() -> Iterator[Daemon]:
    """A daemon of its own, started over a stale socket, with socket mode 0600, a 64 KiB body limit and no
    sessions created on first use."""
    root = Path(tempfile.mkdtemp(prefix="kvtd-", dir="/tmp"))
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(root / "kvtierd.sock"))
    stale.close()  # the file stays, and nothing accepts on it: what a crashed daemon leaves
    assert stat.S_ISSOCK((root / "kvtierd.sock").lstat().st_mode)
    d = start_daemon(root, env={"KVTIERD_SOCKET_MODE": "0600", "KVTIERD_MAX_BODY_BYTES": "64KiB",
                                "KVTIERD_SESSION_CREATE_ON_FIRST_USE": "false"})
    yield d
    try:
        assert d.stop() == 0, d.log_text()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def socket_mode(path: Path) -> int:
    st = path.lstat()
    assert stat.S_ISSOCK(st.st_mode)
    return stat.S_IMODE(st.st_mode)


def test_socket_mode_is_0660_by_default(daemon):
    assert socket_mode(daemon.socket) == 0o660


def test_without_create_on_first_use_an_unknown_session_is_404(tuned_daemon):
    with tuned_daemon.client() as api:
        assert_error(api.post(CHAT, json=chat(session_id=f"conv-{uuid.uuid4().hex}")), 404, code="session_not_found")


def test_socket_mode_from_the_environment(tuned_daemon):
    assert socket_mode(tuned_daemon.socket) == 0o600


def test_stale_socket_is_replaced(tuned_daemon):
    with tuned_daemon.client() as c:
        assert c.get("/healthz").status_code == 200
    assert "serving on" in tuned_daemon.log_text()


def test_body_limit_from_the_environment(tuned_daemon):
    with tuned_daemon.client() as c:
        assert_error(c.post(CHAT, json=chat(user="x" * (65 << 10))), 413, code="request_too_large")
        assert c.post(CHAT, json=chat(max_tokens=1, user="x" * (60 << 10))).status_code == 200


def one_line_failure(d: Daemon) -> str:
    """The daemon exits non-zero at once, saying why in one line, without a traceback."""
    rc = d.process.wait(60)
    lines = d.log_text().splitlines()
    assert rc != 0, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines  # not even a "model loaded" line
    return lines[0]


def test_second_daemon_on_a_live_socket_fails_fast(daemon, short_root):
    second = start_daemon(short_root, "--socket", str(daemon.socket), wait=False)
    assert one_line_failure(second) == f"error: another daemon is serving on {daemon.socket}"
    with daemon.client() as c:  # the first one is untouched
        assert c.get("/healthz").status_code == 200


def test_path_that_is_not_a_socket_is_refused(short_root):
    path = short_root / "kvtierd.sock"
    path.write_text("not a socket")
    line = one_line_failure(start_daemon(short_root, wait=False))
    assert line == f"error: {path} exists and is not a socket; refusing to replace it"
    assert path.read_text() == "not a socket"


def test_sigterm_drains_in_flight_streams_and_refuses_new_work(short_root):
    d = start_daemon(short_root)
    try:
        refusals: list[httpx.Response] = []
        with d.client() as c, d.client() as late:
            with c.stream("POST", CHAT, json=chat(messages=STORY, max_tokens=60, stream=True)) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                payloads = [next(line for line in lines if line.startswith("data: "))]
                d.process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + HANG_GUARD_S  # a hang guard, no speed bound
                while not refusals and time.monotonic() < deadline:  # until the daemon has seen the signal
                    try:
                        answer = late.post(CHAT, json=chat(max_tokens=1))
                    except httpx.TransportError:
                        break
                    if answer.status_code == 503:
                        refusals.append(answer)
                payloads += [line for line in lines if line.startswith("data: ")]
        assert refusals, "no request was refused while draining"
        assert_error(refusals[0], 503, type="service_unavailable", code="unavailable")
        assert refusals[0].headers["retry-after"]
        assert payloads[-1] == "data: [DONE]"
        last = json.loads(payloads[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] in ("stop", "length")
        assert d.process.wait(60) == 0, d.log_text()
        assert not d.socket.exists()
        assert "draining: 1 request(s) in flight" in d.log_text()
    finally:
        if d.process.poll() is None:
            d.process.kill()
            d.process.wait()
