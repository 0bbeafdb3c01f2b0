"""Fuzzing the HTTP API of a real daemon: requests generated from its own OpenAPI
document (schemathesis: bodies that follow the schema and bodies that break it),
and a list of hostile bodies. Never a 5xx, never a crash, every error
OpenAI-shaped, and no page or stream left behind.

Its own daemon with a 96-token window and short replies, so generated requests
stay cheap; it runs as root, so the admin routes are fuzzed too.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from jsonschema_rs import Draft202012Validator  # schemathesis's own validator
from schemathesis.core import NOT_SET

from daemon_fixtures import Daemon, start_daemon

FUZZED = Counter()  # (route, status) -> count, printed at the end
# CI replays the same generated requests every run (a landing must not hinge on luck);
# KVTIERD_FUZZ_EXPLORE=1 draws new ones each run, to look for new failures.
EXPLORE = os.environ.get("KVTIERD_FUZZ_EXPLORE") == "1"
MAIN_ROUTES = {("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/sessions", "POST"),
               ("/v1/sessions/{session_id}/messages", "POST")}


@pytest.fixture(scope="module")
def fuzz_daemon() -> Daemon:
    with tempfile.TemporaryDirectory(prefix="kvtierd-") as root:
        d = start_daemon(Path(root), env={"KVTIERD_MAX_MODEL_LEN": "96", "KVTIERD_DEFAULT_MAX_TOKENS": "4",
                                          "KVTIERD_MAX_BODY_BYTES": "64KiB"})
        yield d
        print(f"\nfuzzed requests by route and status: {dict(sorted(FUZZED.items()))}")
        assert d.stop() == 0, d.log_text()
        assert "Traceback" not in d.log_text()


@pytest.fixture(scope="module")
def http(fuzz_daemon: Daemon):
    with fuzz_daemon.client() as c:
        yield c


@pytest.fixture(scope="module")
def schema(http: httpx.Client):
    return schemathesis.openapi.from_dict(http.get("/openapi.json").json())


def check(r: httpx.Response, route: str) -> None:
    FUZZED[(route, r.status_code)] += 1
    assert r.status_code < 500, f"{route}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)


def operations() -> list[tuple[str, str, str]]:
    """(path, method, mode) of every documented operation; "negative" cases only where there is
    something to break (a body or a query parameter: any text is a valid path segment)."""
    from kvtierd.server.openapi import DOCUMENT

    out = []
    for path, ops in DOCUMENT["paths"].items():
        for method, op in ops.items():
            out.append((path, method.upper(), "positive"))
            if "requestBody" in op or any(p["in"] == "query" for p in op.get("parameters", ())):
                out.append((path, method.upper(), "negative"))
    return out


def send(http: httpx.Client, case) -> httpx.Response:
    kw = case.as_transport_kwargs(base_url="http://kvtierd")
    kw.pop("cookies", None)
    headers = {k: v for k, v in kw.pop("headers").items() if k.lower() not in ("connection", "accept-encoding")}
    if "json" in kw:
        kw["content"] = json.dumps(kw.pop("json"))
    return http.request(kw.pop("method"), kw.pop("url"), headers=headers, params=kw.pop("params", None),
                        content=kw.get("content", kw.get("data")))


@dataclass(frozen=True)
class BodySchema:
    """A route's request body as its OpenAPI document states it (3.1: JSON Schema 2020-12)."""

    validator: Draft202012Validator
    required: bool

    def refuses(self, body: object) -> bool:
        """No body where one is required, a body of another media type (bytes), or JSON the schema breaks."""
        if body is NOT_SET or body == b"":
            return self.required
        return isinstance(body, bytes) or not self.validator.is_valid(body)


def body_schema(path: str, method: str) -> BodySchema | None:
    from kvtierd.server.openapi import DOCUMENT

    body = DOCUMENT["paths"][path][method.lower()].get("requestBody")
    if body is None:
        return None
    return BodySchema(Draft202012Validator(body["content"]["application/json"]["schema"]), body.get("required", False))


@pytest.mark.parametrize("path,method,mode", operations())
def test_generated_requests_never_get_a_5xx(http, schema, path, method, mode):
    """And on the main routes, a body that breaks the schema gets a 4xx: refused, not served."""
    strategy = schema[path][method].as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    schema_of_body = body_schema(path, method) if (path, method) in MAIN_ROUTES else None
    refused = []

    @settings(max_examples=12, deadline=None, database=None, derandomize=not EXPLORE,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.filter_too_much])
    @given(strategy)
    def run(case):
        r = send(http, case)
        check(r, f"{method} {path}")
        if schema_of_body is not None and schema_of_body.refuses(case.body):
            assert 400 <= r.status_code < 500, f"{method} {path} served a body that breaks its schema: " \
                                               f"{case.body!r:.300} -> {r.status_code}"
            refused.append(r.status_code)

    run()
    if schema_of_body is not None and mode == "negative":
        assert refused, "no generated body broke the schema: the 4xx check checked nothing"


HOSTILE: list[bytes] = [
    b"",
    b"null",
    b"[]",
    b'"a string"',
    b"12",
    b"{",
    b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # deep nesting
    b'{"messages": [{"role": "user", "content": "' + b"x" * 70_000 + b'"}]}',  # over max_body_bytes
    b'{"messages": [{"role": "user", "content": "\xff\xfe invalid utf-8"}]}',
    b'{"messages": [{"role": "user", "content": "nul \\u0000 inside"}], "max_tokens": 2}',
    b'{"messages": [{"role": "user\\u0000", "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "\\ud800 lone surrogate"}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999999999999999999999999}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": -99999999999999999999999}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stop": [1, 2]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "session_id": 7}',
    b'{"messages": [{"role": "user", "content": "hi"}], "prefix_tag": "' + b"t" * 500 + b'"}',
    b'{"messages": "not a list"}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "messages": []}',
    b'{"prompt": [1, -5, 3]}',
    b'{"prompt": [999999999]}',
    b'{"prompt": [true, false]}',
    b'{"content": ""}',
    b'{"text": "x", "token_ids": [1]}',
    b'{"token_ids": []}',
    b'{"session_id": ["a"]}',
    b'{"hash": "zz"}',
    b'{"tenant": "../../etc"}',
]
POST_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/sessions", "/v1/sessions/nope/messages",
               "/admin/prefixes", "/admin/invalidate"]


@pytest.mark.parametrize("route", POST_ROUTES)
def test_hostile_bodies_get_clear_4xx(http, route):
    """Every hostile body its route's schema refuses (not JSON, or JSON the schema breaks) gets a 4xx."""
    schema_of_body = body_schema(route.replace("/nope/", "/{session_id}/"), "POST")
    for body in HOSTILE:
        r = http.post(route, content=body, headers={"Content-Type": "application/json"})
        check(r, f"POST {route} (hostile)")
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            parsed = body  # not JSON (or nested past what a parser takes): breaks any schema
        if schema_of_body.refuses(parsed):
            assert 400 <= r.status_code < 500, (body[:80], r.status_code)
        assert r.status_code != 200 or route in ("/v1/chat/completions", "/v1/sessions"), body[:80]


def test_hostile_headers_methods_and_raw_bytes(http, fuzz_daemon):
    for headers in ({"X-Kvtierd-Tenant": "bad tenant!"}, {"X-Kvtierd-Tenant": "t" * 500},
                    {"Content-Type": "text/plain"}):
        r = http.post("/v1/chat/completions", content=b'{"messages": []}', headers=headers)
        check(r, "POST /v1/chat/completions (headers)")
    for method in ("PUT", "PATCH", "DELETE"):
        check(http.request(method, "/v1/chat/completions"), f"{method} /v1/chat/completions")
    check(http.get("/no/such/route"), "GET /no/such/route")
    # What no HTTP client sends: a body shorter than its Content-Length, then a hang-up; garbage.
    for raw in (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"me",
                b"\x00\xff GARBAGE \r\n\r\n", b"GET /healthz HTTP/1.1\r\n" + b"X: y\r\n" * 10_000 + b"\r\n"):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(str(fuzz_daemon.socket))
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
            reply = sock.recv(65536)
        assert not reply.startswith(b"HTTP/1.1 5"), reply[:200]
        FUZZED[("raw bytes", int(reply[9:12]) if reply.startswith(b"HTTP/1.1 ") else 0)] += 1


def test_after_the_fuzzing_the_daemon_is_healthy_and_holds_no_pages(http):
    assert http.get("/healthz").json()["status"] == "ok"
    for pin in http.get("/admin/pins").json()["pins"]:  # generated pins hold their pages by design
        assert http.delete(f"/admin/pins/{pin['id']}").status_code == 200
    engine = http.get("/admin/status").json()["engine"]
    assert (engine["running"], engine["waiting"], engine["used_blocks"]) == (0, 0, 0)
    assert http.get("/admin/stats").json()["errors_5xx"] == 0
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Still there?"}],
                                                "max_tokens": 2})
    assert r.status_code == 200
