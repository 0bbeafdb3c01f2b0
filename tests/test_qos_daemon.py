"""QoS and pins on the real daemon: classes per tenant, 503 with Retry-After past the queue limit and when
low is shed, /admin/pins (pin, list, budget, unpin) and pins restored after a restart."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path

import pytest

from daemon_fixtures import start_daemon

TENANT = "X-Kvtierd-Tenant"
ENV = {
    "KVTIERD_MAX_NUM_SEQS": "1",  # one request at a time: the next one queues
    # normal is refused after 0.5 s queued; high and low wait long enough for shedding to come first, however
    # long a step takes on a slow machine
    "KVTIERD_QOS_MAX_QUEUE_S": "high=30,normal=0.5,low=30",
    "KVTIERD_SHED_LOW_AFTER_S": "0.05",  # queued low requests are refused once a high one has waited this long
    "KVTIERD_PIN_SHARE": "0.02",  # 256 MiB of fp32 SmolLM2 pages: 364 pages, 7 of them for pins
    "KVTIERD_TENANT_CLASSES": "vip=high",
    "KVTIERD_TENANT_MAX_CLASSES": "batch=low",
}
PREFIX = list(range(1000, 1064))  # 64 tokens: 4 pages of 16


@pytest.fixture(scope="module")
def root():
    with tempfile.TemporaryDirectory(prefix="kvq-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def daemon(root):
    d = start_daemon(root, env=ENV)
    yield d
    d.stop()


def chat(client, tenant: str, **extra):
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body, headers={TENANT: tenant})


def test_a_request_takes_its_tenants_class_and_is_capped(daemon):
    with daemon.client() as c:
        assert chat(c, "vip").json()["kvtierd"]["priority"] == "high"
        assert chat(c, "vip", priority="low").json()["kvtierd"]["priority"] == "low"  # asked for: lower is allowed
        assert chat(c, "batch", priority="high").json()["kvtierd"]["priority"] == "low"  # the admin's cap
        assert chat(c, "someone").json()["kvtierd"]["priority"] == "normal"


@contextlib.asynccontextmanager
async def seat_taken(c, priority: str):
    """Streams a long request and yields once its first token is out: it holds the one seat (it runs) until the
    block ends and the stream is closed, which aborts it. No clock: its first chunk says it runs. The stream is
    read to the end meanwhile (leaving the iteration early would close the connection, and abort it)."""
    body = {"prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 1000, "temperature": 0, "priority": priority,
            "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as long:
        assert long.status_code == 200
        running = asyncio.Event()

        async def read() -> None:
            try:
                async for line in long.aiter_lines():
                    if line.startswith("data: "):
                        running.set()
            finally:
                running.set()

        reader = asyncio.create_task(read())
        await running.wait()
        assert not reader.done(), "the long request ended before the test could use its seat"
        try:
            yield
        finally:
            reader.cancel()


def test_a_request_waiting_past_its_class_limit_gets_503_with_retry_after(daemon):
    async def main():
        async with daemon.async_client() as c:
            async with seat_taken(c, "normal"):
                return await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "priority": "normal",
                                                             "stream": True})

    short = asyncio.run(main())
    assert short.status_code == 503, short.text
    assert int(short.headers["Retry-After"]) >= 1
    assert "overloaded" in short.json()["error"]["message"]
    with daemon.client() as c:
        assert c.get("/admin/status").json()["engine"]["qos"]["classes"]["normal"]["rejected"] >= 1


def test_a_queued_low_request_is_shed_with_503_while_a_high_one_waits(daemon):
    async def main():
        async with daemon.async_client() as c:
            # The one seat is taken by a high request, which a high one cannot preempt: both queue, and low is
            # shed at the first step boundary after high has waited 0.05 s. The high one runs once the seat frees.
            async with seat_taken(c, "high"):
                high = asyncio.create_task(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1,
                                                                           "priority": "high"}))
                low = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "priority": "low"})
            assert (await high).status_code == 200
            return low

    low = asyncio.run(main())
    assert low.status_code == 503, low.text
    assert int(low.headers["Retry-After"]) >= 1 and "shed" in low.json()["error"]["message"]
    with daemon.client() as c:
        qos = c.get("/admin/status").json()["engine"]["qos"]
        assert qos["shed"] == 1
        assert "kvtierd_qos_shed_total 1.0" in c.get("/metrics").text


def test_pins_are_listed_budgeted_refused_past_the_budget_and_removed(daemon):
    with daemon.client() as c:
        r = c.post("/admin/pins", json={"token_ids": PREFIX, "tenant": "pinner"})
        assert r.status_code == 201, r.text
        pin = r.json()["pin"]
        assert (pin["kind"], pin["pages"], pin["tenant"], pin["tier"]) == ("prefix", 4, "pinner", "device")
        listed = c.get("/admin/pins").json()
        assert [p["id"] for p in listed["pins"]] == [pin["id"]]
        assert (listed["pinned_pages"], listed["budget_pages"]) == (4, 7)

        over = c.post("/admin/pins", json={"token_ids": list(range(2000, 2064)), "tenant": "pinner"})
        assert over.status_code == 409 and "pin budget" in over.json()["error"]["message"]
        assert c.post("/admin/pins", json={"session_id": "sess_missing"}).status_code == 404
        assert c.post("/admin/pins", json={"token_ids": [1, 2]}).status_code == 400  # no full page

        # The pinned prefix is a hit for its tenant.
        hit = c.post("/v1/completions", json={"prompt": PREFIX + [5], "max_tokens": 1},
                     headers={TENANT: "pinner"}).json()
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_pins_are_restored_after_a_restart_and_can_be_removed(daemon, root):
    with daemon.client() as c:
        pins = c.get("/admin/pins").json()["pins"]
    assert pins, "the previous test leaves a pin"
    assert daemon.stop() == 0
    again = start_daemon(root, env=ENV)
    try:
        with again.client() as c:
            restored = c.get("/admin/pins").json()
            assert [(p["id"], p["pages"]) for p in restored["pins"]] == [(pins[0]["id"], 4)]
            r = c.delete(f"/admin/pins/{pins[0]['id']}")
            assert r.status_code == 200 and r.json()["freed_pages"] == 4
            assert c.get("/admin/pins").json()["pins"] == []
            assert c.delete(f"/admin/pins/{pins[0]['id']}").status_code == 404
    finally:
        assert again.stop() == 0, again.log_text()
