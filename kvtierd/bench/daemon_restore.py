"""`kvtierd bench tiers`, through the daemon: a stored session's next turn after a restart, as a user sees it.

A daemon of the bench's own, with its default tiers (host and disk under its state directory):

1. a session is created and its first turn sent: a long document and a question;
2. SIGTERM: the daemon flushes the session's pages to disk and stops; it starts again in the same state
   directory, settles the disk with the session catalog and warms the recent sessions into the host tier;
3. the session's next turn (the whole history, as OpenAI clients send it, with `session_id`), streamed,
   beside the same history sent as a fresh tenant's request (nothing of it cached: all computed).

TTFT is the client's: from sending the request to the first streamed content chunk.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from kvtierd.bench.reuse_bench import document, follow_up, questions
from kvtierd.bench.serve_bench import BASE_URL, REQUEST_TIMEOUT_S, ServeBenchError, started_daemon
from kvtierd.bench.tiers_bench import DaemonRestoreRow
from kvtierd.model.tokenizer import ChatTokenizer

TENANT_HEADER = "X-Kvtierd-Tenant"  # [server] tenant_header's default; only root or the admin group may send it
WARM_GUARD_S = 300.0  # a warm-up not done by then is broken, not slow
REPLY_TOKENS = 8


def run_daemon_restore(tok: ChatTokenizer, doc_tokens: int) -> DaemonRestoreRow:
    """The daemon serves its configured model (the bundled one unless KVTIERD_MODEL says otherwise)."""
    first = [{"role": "user", "content": f"{document(tok, doc_tokens, seed=7)}\n\n{questions(1)[0]}"}]
    root = Path(tempfile.mkdtemp(prefix="kvtd-tiers-", dir="/tmp"))  # short: a socket path fits sun_path
    try:
        with started_daemon(root=root) as sock, _client(sock) as c:
            sid = _ok(c.post("/v1/sessions", json={"title": "bench tiers"}))["id"]
            reply = _ok(c.post(f"/v1/sessions/{sid}/messages",
                               json={"content": first[0]["content"], "max_tokens": REPLY_TOKENS, "temperature": 0}))
            history = first + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                               {"role": "user", "content": follow_up(1)}]
        with started_daemon(root=root) as sock, _client(sock) as c:  # the restart: same state directory
            _wait_warmed(root / "daemon.log")
            body = {"messages": history, "max_tokens": REPLY_TOKENS, "temperature": 0}
            recompute = _streamed(c, body, headers={TENANT_HEADER: "bench-fresh-tenant"})
            restored = _streamed(c, {**body, "session_id": sid})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (ttft_r, text_r, usage_r, _), (ttft_s, text_s, usage_s, by_tier) = recompute, restored
    return DaemonRestoreRow(usage_s["prompt_tokens"], ttft_s * 1e3, ttft_r * 1e3, ttft_r / ttft_s,
                            {t: n for t, n in by_tier.items() if n}, text_r == text_s)


def _client(sock: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url=BASE_URL, timeout=REQUEST_TIMEOUT_S)


def _ok(r: httpx.Response) -> dict:
    if not r.is_success:
        raise ServeBenchError(f"the daemon answered {r.status_code}: {r.text[:300]}")
    return r.json()


def _wait_warmed(log: Path) -> None:
    """Until the restarted daemon says the recent sessions are in the host tier (or that it could not)."""
    deadline = time.monotonic() + WARM_GUARD_S
    while "warmed into the host tier" not in (text := log.read_text(errors="replace").split("serving on")[-1]):
        if time.monotonic() > deadline:
            raise ServeBenchError(f"the restarted daemon did not warm its sessions in {WARM_GUARD_S:.0f} s")
        time.sleep(0.05)
    if "not warmed" in text:
        raise ServeBenchError("the restarted daemon could not warm its sessions: see its log")


def _streamed(c: httpx.Client, body: dict, headers: dict | None = None) -> tuple[float, str, dict, dict]:
    """TTFT (s), the reply, usage and cached tokens by tier of one streamed chat request."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, usage, info, first = [], None, {}, None
    t0 = time.perf_counter()
    with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            raise ServeBenchError(f"the daemon answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if content := choice.get("delta", {}).get("content"):
                    first = first or time.perf_counter()
                    text.append(content)
            usage = chunk.get("usage") or usage
            info = chunk.get("kvtierd") or info
    if first is None or usage is None:
        raise ServeBenchError("a streamed reply carried no content or no usage")
    return first - t0, "".join(text), usage, info.get("cached_tokens_by_tier", {})
