"""Admin routes for the prefix cache: list cached prefixes, publish one to every
tenant, and invalidate what is cached (by session, prefix, hash, tag, tenant or model).

A prefix is given by `text` (tokenized as is), `messages` (rendered with the chat
template, without the assistant's cue, so a chat that starts with them matches)
or `token_ids`.
"""

from __future__ import annotations

import time
from functools import partial

from aiohttp import web

from kvtierd.engine.llm_engine import PUBLIC_NAMESPACE
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.server.errors import ApiError, bad_request
from kvtierd.server.generation import Generation
from kvtierd.server.middleware import TENANT_NAME, read_json
from kvtierd.server.schemas import parse_messages, parse_tag, require_object
from kvtierd.server.session_routes import query_limit, session_tenant
from kvtierd.server.state import STATE, DaemonState

routes = web.RouteTableDef()

PREFIX_FIELDS = {"text", "messages", "token_ids"}
PREVIEW_TOKENS = 48


def prefix_tokens(state: DaemonState, body: dict) -> list[int]:
    """The token ids of a prefix given as exactly one of text, messages or token_ids."""
    given = sorted(PREFIX_FIELDS & set(body))
    if len(given) != 1:
        raise bad_request("give the prefix as exactly one of text, messages or token_ids", param="prefix")
    tok = state.loaded.tokenizer
    if "text" in body:
        if not isinstance(body["text"], str) or not body["text"]:
            raise bad_request("text must be a non-empty string", param="text")
        return tok.encode(body["text"])
    if "messages" in body:
        return tok.encode_chat(parse_messages(body["messages"]), add_generation_prompt=False)
    ids = body["token_ids"]
    vocab = state.loaded.config.vocab_size
    if not (isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < vocab for t in ids)):
        raise bad_request(f"token_ids must be a non-empty array of token ids in [0, {vocab})", param="token_ids")
    return ids


def tenant_param(body: dict) -> str:
    tenant = body.get("tenant", "")
    if not isinstance(tenant, str) or (tenant and tenant != "public" and not TENANT_NAME.match(tenant)):
        raise bad_request("tenant must be a tenant name, or \"public\" for the public namespace", param="tenant")
    return PUBLIC_NAMESPACE if tenant == "public" else tenant


@routes.get("/admin/prefixes")
async def list_prefixes(request: web.Request) -> web.Response:
    """Cached prefixes: each chain's last page, most hit first (`?tenant=` filters, "public" too)."""
    state = request.app[STATE]
    eng = state.engine.engine
    pool = eng.kv.pool
    want = request.query.get("tenant")
    if want == "public":
        want = PUBLIC_NAMESPACE
    bs, now, tok = eng.config.block_size, time.monotonic(), state.loaded.tokenizer
    rows = []
    for b, page in pool.cached_blocks():
        tenant = eng.namespaces.get(page.root)
        if not pool.index.is_leaf(b) or (want is not None and tenant != want):
            continue
        chain = pool.index.chain_to(b)
        head = [t for p in chain[: -(-PREVIEW_TOKENS // bs)] for t in pool.page_info(p).tokens][:PREVIEW_TOKENS]
        rows.append({
            "hash": page.block_hash.hex(), "tenant": "public" if tenant == PUBLIC_NAMESPACE else tenant,
            "num_tokens": (page.depth + 1) * bs, "pages": len(chain), "hits": pool.index.hits.get(b, 0),
            "first_page_hits": pool.index.hits.get(chain[0], 0),
            "last_hit_s_ago": now - pool.index.last_access.get(b, now), "in_use": pool.ref_count(b) > 0,
            "tier": "device", "pinned": False, "tags": sorted(pool.index.tags.get(b, ())),
            "preview": tok.decode(head),
        })
    rows.sort(key=lambda r: (-r["first_page_hits"], -r["hits"], r["last_hit_s_ago"]))
    return web.json_response({"prefixes": rows[: query_limit(request)]})


@routes.post("/admin/prefixes")
async def publish_prefix(request: web.Request) -> web.Response:
    """Computes a prefix into the public namespace, which every tenant's requests may hit."""
    state = request.app[STATE]
    body = require_object(await read_json(request), PREFIX_FIELDS | {"tag"})
    ids = prefix_tokens(state, body)
    bs = state.engine.engine.config.block_size
    if len(ids) < bs:
        raise bad_request(f"the prefix has {len(ids)} tokens; only whole pages of {bs} are shared", param="prefix")
    gen = Generation(state.engine, ids, SamplingParams(max_tokens=1, temperature=0.0), PUBLIC_NAMESPACE,
                     tag=parse_tag(body.get("tag"), "tag"))
    result = await gen.run()
    eng = state.engine.engine
    hit = await state.engine.call(lambda: eng.kv.find_prefix(eng.kv.public_root, ids + [0]))
    if hit.num_tokens == 0:
        raise ApiError(503, "the prefix was computed but its pages were evicted at once; raise kv_cache_bytes",
                       code="cache_full")
    return web.json_response({"namespace": "public", "hash": hit.block_hashes[-1].hex(), "num_tokens": hit.num_tokens,
                              "pages": len(hit.block_ids), "prompt_tokens": len(ids),
                              "computed_tokens": result.prompt_tokens - result.cached_tokens})


INVALIDATE_FIELDS = {"session_id", "prefix", "hash", "tag", "tenant", "model"}


@routes.post("/admin/invalidate")
async def invalidate(request: web.Request) -> web.Response:
    """Unindexes cached KV at once for new requests; pages running requests hold are freed when they finish.

    One target: `session_id`, `prefix` ({text|messages|token_ids}, in `tenant`'s
    namespace or "public"), `hash`, `tag`, `tenant` alone, or `model` (a fingerprint)."""
    state = request.app[STATE]
    body = require_object(await read_json(request), INVALIDATE_FIELDS)
    targets = sorted(set(body) - {"tenant"}) or (["tenant"] if "tenant" in body else [])
    if len(targets) != 1:
        raise bad_request("give one of session_id, prefix, hash, tag, model, or tenant alone", param="target")
    target = targets[0]
    eng = state.engine.engine
    if target == "session_id":
        sid = body["session_id"]
        if not isinstance(sid, str):
            raise bad_request("session_id must be a string", param="session_id")
        tenant = await session_tenant(state, sid, tenant_param(body) or None, param="session_id")
        change = partial(eng.invalidate_session, sid, tenant)
    elif target == "prefix":
        prefix = body["prefix"]
        if not isinstance(prefix, dict):
            raise bad_request("prefix must be an object with text, messages or token_ids", param="prefix")
        ids, tenant = prefix_tokens(state, require_object(prefix, PREFIX_FIELDS)), tenant_param(body)
        change = partial(eng.invalidate_prefix, ids, tenant)
    elif target == "hash":
        try:
            block_hash = bytes.fromhex(body["hash"])
        except (TypeError, ValueError):
            raise bad_request("hash must be a page hash in hex (as /admin/prefixes lists)", param="hash") from None
        change = partial(eng.invalidate_hash, block_hash)
    elif target == "tag":
        tag = parse_tag(body["tag"], "tag")
        change = partial(eng.invalidate_tag, tag)
    elif target == "tenant":
        tenant = tenant_param(body)
        if not tenant:
            raise bad_request("tenant must name a tenant", param="tenant")
        change = partial(eng.invalidate_tenant, tenant)
    else:
        fingerprint = body["model"]
        if not isinstance(fingerprint, str):
            raise bad_request("model must be a model fingerprint (as /admin/status shows)", param="model")
        change = partial(eng.invalidate_model, fingerprint)
    pages = await state.engine.call(change)
    return web.json_response({"target": target, "invalidated_pages": pages})
