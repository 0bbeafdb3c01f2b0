"""The daemon's HTTP API as a chat frontend uses it, over the real Unix socket.

A real `kvtierd serve` (the session's `daemon` fixture) answers the official
openai client, raw httpx and curl. A second daemon with a world-writable socket
lets a forked child running as `nobody` knock as an unprivileged peer. Replies
are greedy (temperature 0) and short, so they can be compared across routes,
clients and load.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from daemon_fixtures import Daemon, start_daemon

TENANT = "X-Kvtierd-Tenant"  # settings.tenant_header's default
GREEDY = {"temperature": 0, "max_tokens": 8}
NOBODY = 65534

# The bundled SmolLM2-135M-Instruct's tokens for FRANCE (its GGUF tokenizer adds no BOS).
BUNDLED_MODEL = "SmolLM2-135M-Instruct"
FRANCE = "The capital of France is"
FRANCE_IDS = [504, 3575, 282, 4649, 314]

SYSTEM = "You are a terse assistant. Answer every question in one short sentence."
QUESTIONS = (  # each well over a 16-token page, so every turn adds cached pages
    "Tell me about the moon, and why its shape seems to change from night to night over a month.",
    "And what about the sun: why does it look yellow at noon but red and orange at sunset?",
    "Finally, explain in simple words why the sky is blue on a clear day and black at night.",
)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def tenant(name: str) -> dict[str, str]:
    """Headers naming a tenant unique to this run (root is an admin, so it may)."""
    return {TENANT: f"{name}-{uuid.uuid4().hex[:8]}"}


def sse_data(lines: list[str]) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def streamed_text(payloads: list[str]) -> str:
    """The assistant text of a chat stream's chunks (the `[DONE]` marker and usage chunk skipped)."""
    chunks = [json.loads(p) for p in payloads if p != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


@pytest.fixture(scope="module")
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with daemon.client() as client:
        yield client


@pytest.fixture(scope="module")
def client(daemon: Daemon):
    with daemon.openai() as c:
        yield c


@pytest.fixture(scope="module")
def model_id(http: httpx.Client) -> str:
    return http.get("/healthz").json()["model"]


# --- the official openai client ---------------------------------------------------------------

COLOURS = [user("Name three colours, one per line.")]


@pytest.fixture(scope="module")
def whole(client, model_id):
    """One greedy non-streamed chat completion; the streamed variants must match it."""
    return client.chat.completions.create(model=model_id, messages=COLOURS, **GREEDY)


def test_chat_completion_reports_usage_cache_and_timings(whole, model_id):
    assert whole.object == "chat.completion" and whole.model == model_id
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    usage = whole.usage
    assert usage.completion_tokens == GREEDY["max_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens is not None
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    extra = whole.model_extra["kvtierd"]
    assert extra["cached_tokens_by_tier"] == {"device": usage.prompt_tokens_details.cached_tokens, "host": 0, "disk": 0, "remote": 0}
    assert extra["queue_ms"] >= 0 and extra["ttft_ms"] > 0


def test_openai_stream_has_the_same_text(client, model_id, whole):
    chunks = list(client.chat.completions.create(model=model_id, messages=COLOURS, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    assert all(c.usage is None for c in chunks) and len({c.id for c in chunks}) == 1


def test_include_usage_adds_a_final_usage_chunk(client, model_id, whole):
    chunks = list(client.chat.completions.create(model=model_id, messages=COLOURS, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    *text_chunks, last = chunks
    assert last.choices == [] and all(c.usage is None for c in text_chunks)
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    cached = last.usage.prompt_tokens_details.cached_tokens
    assert cached > 0  # the same prompt ran before
    assert last.model_extra["kvtierd"]["cached_tokens_by_tier"] == {"device": cached, "host": 0, "disk": 0, "remote": 0}
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == whole.choices[0].message.content


def test_raw_sse_stream_ends_with_done(http, model_id, whole):
    body = {"model": model_id, "messages": COLOURS, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    payloads = sse_data(lines)
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    assert [line for line in lines if line] == [f"data: {p}" for p in payloads]  # nothing but data events
    assert streamed_text(payloads) == whole.choices[0].message.content


def test_logprobs_give_sorted_top_alternatives(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=COLOURS, logprobs=True, top_logprobs=3, **GREEDY)
    entries = r.choices[0].logprobs.content
    assert r.choices[0].finish_reason == "length" and len(entries) == r.usage.completion_tokens
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.logprob <= 0
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(tops[0])  # greedy picks the top
        assert e.bytes == list(e.token.encode())
    assert "".join(e.token for e in entries) == r.choices[0].message.content


def test_completions_from_text_and_from_token_ids(client, model_id):
    if not model_id.startswith(BUNDLED_MODEL):
        pytest.skip(f"FRANCE_IDS are {BUNDLED_MODEL}'s tokens; the daemon serves {model_id}")
    by_text = client.completions.create(model=model_id, prompt=FRANCE, **GREEDY)
    by_ids = client.completions.create(model=model_id, prompt=FRANCE_IDS, **GREEDY)
    assert by_text.object == "text_completion"
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(FRANCE_IDS)
    assert by_text.choices[0].text and by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.choices[0].finish_reason == by_text.choices[0].finish_reason == "length"


def test_completion_logprobs_take_a_count_as_in_the_legacy_api(http, client, model_id):
    r = client.completions.create(model=model_id, prompt=FRANCE, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and value <= 0 and max(top.values()) == pytest.approx(value) and token in top
    too_many = http.post("/v1/completions", json={"prompt": FRANCE, "logprobs": 21, "max_tokens": 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"


def test_models_lists_the_served_model(client, model_id):
    models = client.models.list().data
    assert [m.id for m in models] == [model_id]
    assert models[0].owned_by == "kvtierd" and models[0].model_extra["context_window"] > 0


# --- sessions -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    session_id: str
    replies: list[str]
    cached_tokens: list[int]

    def turn_texts(self) -> list[str]:
        """Question, reply, question, reply...: what the session stores."""
        return [text for q, a in zip(QUESTIONS, self.replies) for text in (q, a)]

    def history(self, num_turns: int) -> list[dict[str, str]]:
        """The system prompt, `num_turns` earlier turns and the next question, as a full-history client sends."""
        messages = [{"role": "system", "content": SYSTEM}]
        for q, a in zip(QUESTIONS[:num_turns], self.replies):
            messages += [user(q), {"role": "assistant", "content": a}]
        return messages + [user(QUESTIONS[num_turns])]


def create_session(http: httpx.Client, **headers: str) -> dict:
    r = http.post("/v1/sessions", json={"system_prompt": SYSTEM, "title": "api test"}, headers=headers)
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture(scope="module")
def conversation(http, client, model_id) -> Conversation:
    """Three turns through /v1/chat/completions with session_id, sending only the new message."""
    sid = create_session(http)["id"]
    replies, cached = [], []
    for q in QUESTIONS:
        r = client.chat.completions.create(model=model_id, messages=[user(q)], extra_body={"session_id": sid}, **GREEDY)
        assert r.model_extra["kvtierd"]["session_id"] == sid
        replies.append(r.choices[0].message.content)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    return Conversation(sid, replies, cached)


def test_create_session_returns_its_id(http):
    body = create_session(http)
    assert body["object"] == "session" and body["id"]
    assert body["system_prompt"] == SYSTEM and body["tenant"] == "root" and body["qos_class"] == "normal"


def test_each_session_turn_reuses_the_cached_history(conversation):
    _, second, third = conversation.cached_tokens
    assert 0 < second < third
    assert all(conversation.replies)


def test_session_stores_every_turn_in_order(http, conversation):
    r = http.get(f"/v1/sessions/{conversation.session_id}")
    assert r.status_code == 200
    body = r.json()
    assert body["system_prompt"] == SYSTEM and body["num_messages"] == 6
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    assert [m["content"] for m in messages] == conversation.turn_texts()
    assert [m["seq"] for m in messages] == sorted({m["seq"] for m in messages})
    assert {m["status"] for m in messages} == {"complete"}
    assert all(m["completion_tokens"] == GREEDY["max_tokens"] for m in messages if m["role"] == "assistant")


def test_full_history_client_gets_the_same_replies(http, client, model_id, conversation):
    sid = create_session(http)["id"]
    for turn, expected in enumerate(conversation.replies):
        r = client.chat.completions.create(model=model_id, messages=conversation.history(turn),
                                           extra_body={"session_id": sid}, **GREEDY)
        assert r.choices[0].message.content == expected, f"turn {turn + 1}"
    stored = http.get(f"/v1/sessions/{sid}").json()["messages"]  # the resent history is not stored twice
    assert [m["content"] for m in stored] == conversation.turn_texts()


def test_streamed_turn_is_stored_by_the_time_done_arrives(http, client, model_id, conversation):
    """The openai client stops reading at [DONE]; a frontend may send its next turn at once."""
    sid = create_session(http)["id"]
    for turn, expected in enumerate(conversation.replies):
        chunks = client.chat.completions.create(model=model_id, messages=[user(QUESTIONS[turn])], stream=True,
                                                extra_body={"session_id": sid}, **GREEDY)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected, f"turn {turn + 1}"
        stored = http.get(f"/v1/sessions/{sid}").json()["messages"]
        assert [m["content"] for m in stored[-2:]] == [QUESTIONS[turn], expected], f"turn {turn + 1}"
        assert {m["status"] for m in stored} == {"complete"}


def test_stateful_route_matches_stateless_full_history(http, model_id, conversation):
    sid = create_session(http)["id"]
    for turn in range(2):
        stateful = http.post(f"/v1/sessions/{sid}/messages", json={"content": QUESTIONS[turn], **GREEDY})
        assert stateful.status_code == 200, stateful.text
        stateless = http.post("/v1/chat/completions",
                              json={"model": model_id, "messages": conversation.history(turn), **GREEDY})
        reply = stateful.json()["choices"][0]["message"]["content"]
        assert reply == stateless.json()["choices"][0]["message"]["content"] == conversation.replies[turn]
        assert "session_id" not in stateless.json()["kvtierd"]
    assert http.get(f"/v1/sessions/{sid}").json()["num_messages"] == 4


def test_deleted_session_is_gone(http):
    sid = create_session(http)["id"]
    r = http.delete(f"/v1/sessions/{sid}")
    assert r.status_code == 200 and r.json()["deleted"] is True and r.json()["id"] == sid
    gone = http.get(f"/v1/sessions/{sid}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
    assert http.delete(f"/v1/sessions/{sid}").status_code == 404


# --- frontends' own conversation ids -------------------------------------------------------------


def test_a_client_chosen_id_is_kept_and_taken_once_per_tenant(http):
    alice, bob = tenant("alice"), tenant("bob")
    sid = f"chat-{uuid.uuid4()}"
    made = http.post("/v1/sessions", json={"id": sid, "system_prompt": SYSTEM}, headers=alice)
    assert made.status_code == 201 and made.json()["id"] == sid
    again = http.post("/v1/sessions", json={"id": sid}, headers=alice)
    assert again.status_code == 409 and again.json()["error"]["code"] == "session_exists"
    assert http.post("/v1/sessions", json={"id": sid}, headers=bob).status_code == 201  # bob's own
    assert http.get(f"/v1/sessions/{sid}", headers=alice).json()["system_prompt"] == SYSTEM
    assert http.get(f"/v1/sessions/{sid}", headers=bob).json()["system_prompt"] is None


@pytest.mark.parametrize("sid", ["", "a" * 129, "has space", "a/b", "ünï", 42])
def test_a_bad_client_chosen_id_is_refused(http, sid):
    r = http.post("/v1/sessions", json={"id": sid})
    assert r.status_code == 400 and r.json()["error"]["param"] == "id"
    r = http.post("/v1/chat/completions", json={"messages": [user("Hi")], "session_id": sid, **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"


def test_an_unknown_session_id_is_created_on_first_use(http, client, model_id, conversation):
    """A frontend sends its own conversation id and the whole history each turn, as OpenAI clients do."""
    sid = f"conv-{uuid.uuid4().hex}"
    replies = []
    for turn in range(2):
        history = conversation.history(0)[:1]  # the system message
        for q, a in zip(QUESTIONS[:turn], replies):
            history += [user(q), {"role": "assistant", "content": a}]
        r = client.chat.completions.create(model=model_id, messages=history + [user(QUESTIONS[turn])],
                                           extra_body={"session_id": sid}, **GREEDY)
        replies.append(r.choices[0].message.content)
    assert replies == conversation.replies[:2]  # the same conversation as a session created first
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    stored = http.get(f"/v1/sessions/{sid}").json()
    assert stored["system_prompt"] == SYSTEM  # the first request's system message
    assert [m["content"] for m in stored["messages"]] == conversation.turn_texts()[:4]


@pytest.mark.parametrize("messages", [[user("Hi"), {"role": "assistant", "content": "Hello"}],
                                      [user("Hi"), {"role": "system", "content": "Be terse."}, user("Hi")]])
def test_a_bad_first_request_creates_no_session(http, messages):
    sid = f"conv-{uuid.uuid4().hex}"
    r = http.post("/v1/chat/completions", json={"messages": messages, "session_id": sid, **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert http.get(f"/v1/sessions/{sid}").status_code == 404


def test_one_id_under_two_tenants_is_two_conversations(http):
    alice, bob = tenant("alice"), tenant("bob")
    sid = f"conv-{uuid.uuid4().hex}"
    for who, question in ((alice, QUESTIONS[0]), (bob, QUESTIONS[1])):
        r = http.post("/v1/chat/completions", json={"messages": [user(question)], "session_id": sid, **GREEDY},
                      headers=who)
        assert r.status_code == 200, r.text
    for who, question in ((alice, QUESTIONS[0]), (bob, QUESTIONS[1])):
        assert http.get(f"/v1/sessions/{sid}", headers=who).json()["messages"][0]["content"] == question
    ambiguous = http.get(f"/admin/sessions/{sid}")  # the admin must say whose
    assert ambiguous.status_code == 409 and ambiguous.json()["error"]["code"] == "session_ambiguous"
    assert http.get(f"/admin/sessions/{sid}", params={"tenant": bob[TENANT]}).json()["session"]["tenant"] == bob[TENANT]
    assert http.delete(f"/admin/sessions/{sid}", params={"tenant": alice[TENANT]}).json()["deleted"] is True
    assert http.get(f"/v1/sessions/{sid}", headers=alice).status_code == 404
    assert http.get(f"/admin/sessions/{sid}").json()["session"]["tenant"] == bob[TENANT]  # one owner left


# --- tenancy --------------------------------------------------------------------------------------


def test_sessions_are_private_to_their_tenant(http, conversation):
    alice, bob = tenant("alice"), tenant("bob")
    session = create_session(http, **alice)
    sid = session["id"]
    assert session["tenant"] == alice[TENANT]
    assert http.get(f"/v1/sessions/{sid}", headers=bob).status_code == 404
    assert http.delete(f"/v1/sessions/{sid}", headers=bob).status_code == 404
    assert http.get("/v1/sessions", headers=bob).json()["data"] == []
    assert [s["id"] for s in http.get("/v1/sessions", headers=alice).json()["data"]] == [sid]
    assert http.get(f"/v1/sessions/{sid}", headers=alice).status_code == 200  # bob's delete did nothing

    mine = http.get("/v1/sessions").json()["data"]  # root, naming no tenant, is tenant "root"
    assert {s["tenant"] for s in mine} == {"root"}
    assert conversation.session_id in {s["id"] for s in mine} and sid not in {s["id"] for s in mine}


def test_prefix_cache_is_per_tenant(http):
    alice, bob = tenant("alice"), tenant("bob")
    long_prompt = "Remember this list: " + ", ".join(f"item {i}" for i in range(50)) + ". Which item is last?"
    body = {"messages": [user(long_prompt)], "temperature": 0, "max_tokens": 1}

    def cached(headers: dict[str, str]) -> int:
        r = http.post("/v1/chat/completions", json=body, headers=headers).json()
        assert r["usage"]["prompt_tokens"] > 100
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(alice) == 0
    assert cached(bob) == 0  # alice's pages are not bob's
    assert cached(alice) > 0


@pytest.fixture(scope="module")
def open_daemon() -> Iterator[Daemon]:
    """A second daemon whose socket (0666) an unprivileged user may connect to."""
    root = Path(tempfile.mkdtemp(prefix="kvtierd-open-"))  # short: sun_path holds ~107 bytes
    root.chmod(0o755)  # so nobody can reach the socket inside
    d = start_daemon(root, env={"KVTIERD_SOCKET_MODE": "0666"})
    try:
        yield d
        assert d.stop() == 0, d.log_text()
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def raw_request(method: str, path: str, body: dict | None = None, headers: dict[str, str] | None = None) -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", "Host: kvtierd", "Connection: close", f"Content-Length: {len(data)}"]
    if body is not None:
        lines.append("Content-Type: application/json")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def as_nobody(sock: Path, *requests: bytes) -> list[tuple[str, str]]:
    """Sends each raw HTTP/1.1 request from a forked child running as nobody: (status line, body) each."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, knock, report through the pipe, and leave without running pytest code
        code, payload = 1, b""
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            answers = []
            for raw in requests:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(60)
                    s.connect(str(sock))
                    s.sendall(raw)
                    response = b""
                    while chunk := s.recv(65536):
                        response += chunk
                head, _, body = response.partition(b"\r\n\r\n")
                answers.append([head.split(b"\r\n")[0].decode(), body.decode()])
            payload, code = json.dumps(answers).encode(), 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent, never raised in a forked pytest
            payload = repr(e).encode()
        finally:
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(write_end, view):]
            finally:
                os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        payload = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the nobody child failed: {payload.decode()}"
    return [tuple(a) for a in json.loads(payload)]


def test_non_admin_peer_may_not_see_admin_or_name_a_tenant(open_daemon):
    admin, named = as_nobody(open_daemon.socket, raw_request("GET", "/admin/status"),
                             raw_request("GET", "/v1/sessions", headers={TENANT: "alice"}))
    for status, body in (admin, named):
        assert status.startswith("HTTP/1.1 403"), (status, body)
        assert json.loads(body)["error"]["code"] == "forbidden"
    with open_daemon.client() as root:  # root on the same socket may do both
        assert root.get("/admin/status").status_code == 200
        assert root.get("/v1/sessions", headers={TENANT: "alice"}).status_code == 200


def test_non_admin_peer_is_its_own_tenant(open_daemon):
    health, created, listed = as_nobody(open_daemon.socket, raw_request("GET", "/healthz"),
                                        raw_request("POST", "/v1/sessions", {"title": "mine"}),
                                        raw_request("GET", "/v1/sessions"))
    assert health[0] == "HTTP/1.1 200 OK" and json.loads(health[1])["status"] == "ok"
    assert created[0].startswith("HTTP/1.1 201"), created
    session = json.loads(created[1])
    assert session["tenant"] == "nobody"
    assert [s["id"] for s in json.loads(listed[1])["data"]] == [session["id"]]
    with open_daemon.client() as root:
        assert root.get(f"/admin/sessions/{session['id']}").json()["session"]["tenant"] == "nobody"
        assert root.get(f"/v1/sessions/{session['id']}").status_code == 404  # not root's


def test_non_admin_peer_may_read_metrics(open_daemon):
    (metrics,) = as_nobody(open_daemon.socket, raw_request("GET", "/metrics"))  # like /healthz: no admin needed
    assert metrics[0] == "HTTP/1.1 200 OK" and "# TYPE kvtierd_requests_total counter" in metrics[1]


# --- concurrency ----------------------------------------------------------------------------------

NUM_CONCURRENT = 32


async def stream_reply(http: httpx.AsyncClient, body: dict, headers: dict[str, str] | None = None) -> str:
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200
        payloads = sse_data([line async for line in r.aiter_lines()])
    assert payloads[-1] == "[DONE]"
    return streamed_text(payloads)


def test_concurrent_streams_match_solo_runs(daemon, http):
    bodies = [{"messages": [user(f"Write one line about the number {i}.")], **GREEDY} for i in range(NUM_CONCURRENT)]
    solo_tenant = tenant("solo")  # its own cache namespace: the batch below starts cold too

    async def solo() -> list[str]:
        async with daemon.async_client() as c:
            return [await stream_reply(c, b, solo_tenant) for b in bodies]

    async def together() -> list[str]:
        async with daemon.async_client() as c:
            return await asyncio.gather(*(stream_reply(c, b) for b in bodies))

    alone = asyncio.run(solo())
    concurrent = asyncio.run(together())
    assert all(alone) and len(set(alone)) > 1
    assert concurrent == alone
    engine = http.get("/admin/status").json()["engine"]
    assert (engine["running"], engine["waiting"], engine["used_blocks"]) == (0, 0, 0)


# --- the OpenAPI document -------------------------------------------------------------------------


def test_openapi_documents_every_route(http):
    from kvtierd.server.app import ROUTE_TABLES

    registered = {(route.method.lower(), route.path) for table in ROUTE_TABLES for route in table}
    doc = http.get("/openapi.json").json()
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert registered - documented == set(), "routes missing from /openapi.json"
    assert documented - registered == set(), "/openapi.json documents routes that do not exist"


# --- curl, as in the README -----------------------------------------------------------------------

CURL_CHAT = """curl -s --unix-socket {sock} http://localhost/v1/chat/completions \\
  -H 'Content-Type: application/json' \\
  -d '{{"messages": [{{"role": "user", "content": "Say hello."}}], "max_tokens": 8, "temperature": 0}}'"""
CURL_STREAM = """curl -sN --unix-socket {sock} http://localhost/v1/chat/completions \\
  -H 'Content-Type: application/json' \\
  -d '{{"messages": [{{"role": "user", "content": "Say hello."}}], "max_tokens": 8, "temperature": 0, "stream": true}}'"""
CURL_NEW_SESSION = """curl -s --unix-socket {sock} http://localhost/v1/sessions \\
  -H 'Content-Type: application/json' -d '{{"system_prompt": "You are terse."}}'"""
CURL_SESSION_MESSAGE = """curl -s --unix-socket {sock} http://localhost/v1/sessions/{sid}/messages \\
  -H 'Content-Type: application/json' -d '{{"content": "Say hello.", "max_tokens": 8, "temperature": 0}}'"""


def curl(example: str, **values: str) -> str:
    done = subprocess.run(["sh", "-c", example.format(**values)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_examples(daemon):
    sock = str(daemon.socket)
    reply = json.loads(curl(CURL_CHAT, sock=sock))
    text = reply["choices"][0]["message"]["content"]
    assert reply["object"] == "chat.completion" and text

    payloads = sse_data(curl(CURL_STREAM, sock=sock).splitlines())
    assert payloads[-1] == "[DONE]" and streamed_text(payloads) == text

    session = json.loads(curl(CURL_NEW_SESSION, sock=sock))
    answer = json.loads(curl(CURL_SESSION_MESSAGE, sock=sock, sid=session["id"]))
    assert answer["kvtierd"]["session_id"] == session["id"] and answer["choices"][0]["message"]["content"]
