"""`kvtierd bench chat`: the workload users compare systems on, through the daemon's socket.

Several chat sessions, each opened with a long document of its own (a question
about it), then short follow-up questions; the sessions' turns interleave
(round robin: every session's first turn, then every session's second, ...),
one request at a time, as a person switching between conversations would.
Every request streams through the official `openai` client over the Unix
socket, temperature 0, with `max_tokens` replies. Two ways to talk to kvtierd:

- full history: each request carries the whole conversation, as OpenAI
  clients send it; the prefix index finds what was computed before;
- stored sessions: a session is created for each conversation and each
  request carries only the new message with its `session_id`; the daemon keeps
  the history and the session's KV.

Each way gets a daemon of its own (started by the bench; with `--socket`, one
tenant of its own on that daemon), so neither finds the other's KV.

`--peer llamacpp` runs the same conversations (full history) on
llama-cpp-python in this process, when it is importable: the same GGUF file,
the same thread count, its RAM prompt cache (`LlamaRAMCache`), streamed.

TTFT is the client's: from sending a request to its first content chunk; ITL
the gaps between content chunks (a chunk may carry more than one token).
First turns (the document) and later turns are reported apart.
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvtierd.bench.reuse_bench import document, follow_up, questions
from kvtierd.bench.serve_bench import BASE_URL, REQUEST_TIMEOUT_S, ServeBenchError, percentile, started_daemon
from kvtierd.model.tokenizer import ChatTokenizer

TENANT_HEADER = "X-Kvtierd-Tenant"  # [server] tenant_header's default (root or the admin group)
PEER_CACHE_BYTES = 2 << 30  # llama-cpp-python's RAM prompt cache
PEER_CONTEXT = 8192  # the bundled model's window


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    sessions: int = 3
    turns: int = 3  # per session; the first carries the document
    doc_tokens: tuple[int, int] = (1000, 3000)  # each session's document: drawn in this range
    max_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        lo, hi = self.doc_tokens
        if min(self.sessions, self.turns, self.max_tokens, lo) < 1 or hi < lo:
            raise ValueError("sessions, turns, max_tokens and document tokens must be at least 1, and the document "
                             "range low,high")


@dataclass(slots=True)
class Turn:
    session: int
    turn: int  # 0: the document's
    ttft_s: float
    gaps_s: list[float]
    prompt_tokens: int
    cached_tokens: int
    reply: str


@dataclass(frozen=True, slots=True)
class ChatRun:
    system: str  # "kvtierd full history", "kvtierd stored sessions", "llama.cpp (RAM cache)"
    requests: int
    wall_s: float
    first_ttft_p50_ms: float
    first_ttft_p95_ms: float
    later_ttft_p50_ms: float | None  # None: one turn per session
    later_ttft_p95_ms: float | None
    itl_p50_ms: float | None
    itl_p95_ms: float | None
    prompt_tokens: int  # as the system reports them (0: it reports none)
    cached_share: float | None  # of the prompt tokens, served from a cache (None: not reported)
    replies: list[str] = field(default_factory=list)  # in request order


@dataclass(frozen=True, slots=True)
class ChatFigures:
    workload: ChatWorkload
    threads: int  # torch's, in the daemon; llama.cpp's n_threads
    doc_tokens: list[int]  # each session's document, as drawn
    runs: list[ChatRun]
    peer_skipped: str  # why llama.cpp did not run ("" when it did)
    same_replies: dict[str, bool]  # each other run's replies equal the first run's


class Conversations:
    """The sessions' messages; each run fills in its own replies."""

    def __init__(self, tok: ChatTokenizer, w: ChatWorkload) -> None:
        rng = random.Random(w.seed)
        self.w = w
        self.doc_tokens = [rng.randint(*w.doc_tokens) for _ in range(w.sessions)]
        self.openers = [f"{document(tok, n, seed=1000 + i)}\n\n{q}"
                        for i, (n, q) in enumerate(zip(self.doc_tokens, questions(w.sessions), strict=True))]

    def order(self) -> Iterator[tuple[int, int]]:
        """(turn, session), interleaved: every session's turn t before any session's turn t + 1."""
        for t in range(self.w.turns):
            for s in range(self.w.sessions):
                yield t, s

    def user_message(self, session: int, turn: int) -> str:
        return self.openers[session] if turn == 0 else follow_up(turn)


# A system under test: (session, turn, history so far including the new user message) -> the turn's timings.
Send = Callable[[int, int, list[dict]], Turn]


def run_conversations(name: str, conv: Conversations, send: Send) -> ChatRun:
    histories: list[list[dict]] = [[] for _ in range(conv.w.sessions)]
    turns: list[Turn] = []
    t0 = time.perf_counter()
    for t, s in conv.order():
        histories[s].append({"role": "user", "content": conv.user_message(s, t)})
        turn = send(s, t, histories[s])
        histories[s].append({"role": "assistant", "content": turn.reply})
        turns.append(turn)
    wall = time.perf_counter() - t0
    first = [x.ttft_s * 1e3 for x in turns if x.turn == 0]
    later = [x.ttft_s * 1e3 for x in turns if x.turn > 0]
    gaps = [g * 1e3 for x in turns for g in x.gaps_s]
    prompt = sum(x.prompt_tokens for x in turns)
    return ChatRun(name, len(turns), wall, percentile(first, 50), percentile(first, 95),
                   percentile(later, 50) if later else None, percentile(later, 95) if later else None,
                   percentile(gaps, 50) if gaps else None, percentile(gaps, 95) if gaps else None,
                   prompt, sum(x.cached_tokens for x in turns) / prompt if prompt else None,
                   [x.reply for x in turns])


# -- kvtierd, through the socket -----------------------------------------------------------------


def _openai_client(sock: Path, tenant: str | None):
    from openai import OpenAI

    headers = {TENANT_HEADER: tenant} if tenant else None
    return OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", default_headers=headers, max_retries=0,
                  http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=REQUEST_TIMEOUT_S))


def _kvtierd_send(client, sock: Path, tenant: str | None, conv: Conversations, stored: bool) -> Send:
    sessions: dict[int, str] = {}

    def send(session: int, turn: int, history: list[dict]) -> Turn:
        extra: dict = {}
        messages = history
        if stored:
            if session not in sessions:
                sessions[session] = _create_session(sock, tenant)
            extra = {"session_id": sessions[session]}
            messages = history[-1:]  # the daemon keeps the rest
        t0 = time.perf_counter()  # create() returns once the response's headers are in
        stream = client.chat.completions.create(
            model="default", messages=messages, max_tokens=conv.w.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        return _timed_stream(session, turn, stream, t0)

    return send


def _create_session(sock: Path, tenant: str | None) -> str:
    headers = {TENANT_HEADER: tenant} if tenant else {}
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url=BASE_URL, timeout=60) as c:
        r = c.post("/v1/sessions", json={"title": "bench chat"}, headers=headers)
    if not r.is_success:
        raise ServeBenchError(f"creating a session: {r.status_code} {r.text[:200]}")
    return r.json()["id"]


def _timed_stream(session: int, turn: int, stream, t_send: float) -> Turn:
    """Reads an openai chat stream (the daemon's or llama.cpp's chunks, as objects or dicts)."""
    arrivals, text, usage = [], [], None
    for chunk in stream:
        chunk = chunk if isinstance(chunk, dict) else chunk.model_dump()
        for choice in chunk.get("choices") or []:
            if content := (choice.get("delta") or {}).get("content"):
                arrivals.append(time.perf_counter())
                text.append(content)
        usage = chunk.get("usage") or usage
    if not arrivals:
        raise ServeBenchError(f"session {session} turn {turn}: the reply carried no content")
    prompt = (usage or {}).get("prompt_tokens", 0)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Turn(session, turn, arrivals[0] - t_send, [b - a for a, b in zip(arrivals, arrivals[1:])], prompt,
                cached, "".join(text))


@contextlib.contextmanager
def _daemon(socket: Path | None) -> Iterator[Path]:
    if socket is not None:
        yield socket
        return
    with started_daemon() as own:
        yield own


def run_kvtierd(conv: Conversations, stored: bool, socket: Path | None) -> ChatRun:
    name = "kvtierd stored sessions" if stored else "kvtierd full history"
    tenant = f"bench-chat-{uuid.uuid4().hex[:8]}" if socket is not None else None  # its own namespace there
    with _daemon(socket) as sock:
        client = _openai_client(sock, tenant)
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=0)  # a warm-up: first-call costs stay out of the figures
        return run_conversations(name, conv, _kvtierd_send(client, sock, tenant, conv, stored))


# -- llama-cpp-python ------------------------------------------------------------------------------


def peer_unavailable() -> str:
    """Why llama-cpp-python cannot run here ("" when it can)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama_cpp is not importable ({e}); pip install llama-cpp-python --no-deps, diskcache"
    return ""


def run_llamacpp(conv: Conversations, gguf: Path, threads: int) -> ChatRun:
    from llama_cpp import Llama, LlamaRAMCache

    llm = Llama(model_path=str(gguf), n_ctx=PEER_CONTEXT, n_threads=threads, n_threads_batch=threads, seed=0,
                verbose=False)
    llm.set_cache(LlamaRAMCache(capacity_bytes=PEER_CACHE_BYTES))
    llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)  # a warm-up

    def send(session: int, turn: int, history: list[dict]) -> Turn:
        t0 = time.perf_counter()
        stream = llm.create_chat_completion(history, max_tokens=conv.w.max_tokens, temperature=0, stream=True)
        return _timed_stream(session, turn, stream, t0)  # its stream reports no usage: no token counts

    try:
        return run_conversations("llama.cpp (RAM cache)", conv, send)
    finally:
        llm.close()  # frees the model and its context now, not at garbage collection


# -- the run ---------------------------------------------------------------------------------------


def run_chat_bench(tok: ChatTokenizer, w: ChatWorkload, threads: int, socket: Path | None = None,
                   peer: str | None = None, gguf: Path | None = None) -> ChatFigures:
    conv = Conversations(tok, w)
    runs = [run_kvtierd(conv, stored=False, socket=socket), run_kvtierd(conv, stored=True, socket=socket)]
    skipped = "not asked for (--peer llamacpp)"
    if peer == "llamacpp":
        skipped = peer_unavailable() or ("no GGUF file to give it" if gguf is None else "")
        if not skipped:
            runs.append(run_llamacpp(conv, gguf, threads))
    same = {r.system: r.replies == runs[0].replies for r in runs[1:]}
    return ChatFigures(w, threads, conv.doc_tokens, runs, skipped, same)

