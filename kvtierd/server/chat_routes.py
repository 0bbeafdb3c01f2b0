"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from kvtierd.server import openai_format as fmt
from kvtierd.server.conversation import Turn, prepare_chat_turn, record_turn
from kvtierd.server.errors import ApiError
from kvtierd.server.generation import Generation
from kvtierd.server.middleware import read_json
from kvtierd.server.qos import request_class
from kvtierd.server.schemas import GenerationOptions, parse_chat, parse_completion
from kvtierd.server.sse import serve_sse
from kvtierd.server.state import STATE, DaemonState

routes = web.RouteTableDef()


def check_model(state: DaemonState, model: str | None) -> None:
    if model not in (None, state.model_id, "default"):
        raise ApiError(404, f"model {model!r} is not served here; GET /v1/models lists {state.model_id!r}",
                       param="model", code="model_not_found")


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [model_card(state)]})


def model_card(state: DaemonState) -> dict:
    return {"id": state.model_id, "object": "model", "created": int(time.time() - (time.monotonic() - state.started)),
            "owned_by": "kvtierd", "context_window": state.engine.engine.max_model_len,
            "dtype": state.loaded.model.mode.name, "kv_dtype": str(state.loaded.model.kv_dtype).removeprefix("torch.")}


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_chat(await read_json(request), state.settings.default_max_tokens)
    check_model(state, req.model)
    turn = await prepare_chat_turn(state, request["tenant"], req.messages, req.session_id,
                                   req.options.params.max_tokens)
    return await respond_chat(request, state, turn, req.options)


async def respond_chat(request: web.Request, state: DaemonState, turn: Turn, options: GenerationOptions) -> web.StreamResponse:
    """Runs a chat turn and answers it, streamed or whole; records it in its session if any."""
    tok = state.loaded.tokenizer
    qos_class = request_class(state.settings, request["tenant"], options.priority, turn.qos_class)
    gen = Generation(state.engine, turn.prompt_ids, options.params, request["tenant"], turn.session_id,
                     options.prefix_tag, state.metrics.observer(qos_class), qos_class, state.workload,
                     options.retention)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.model_id
    extra: dict = {"priority": qos_class}
    if turn.session_id:
        extra |= {"session_id": turn.session_id, "truncated": turn.truncated and turn.truncated.as_json()}
    if not options.stream:
        result = await gen.run()
        await record_turn(state, request["tenant"], turn, result)
        logprobs = fmt.chat_logprobs(tok, result.logprobs) if options.params.logprobs else None
        return web.json_response(fmt.chat_completion(rid, created, model, result.text, result.finish_reason, logprobs,
                                                     result.usage(), result.kvtierd_info(**extra)))

    await first_output(state, request["tenant"], turn, gen)
    return await serve_sse(request, state, chat_events(state, request["tenant"], turn, gen, options, rid, created, extra))


async def first_output(state: DaemonState, tenant: str, turn: Turn, gen: Generation) -> None:
    """Waits for the first token before the stream starts, so an overloaded daemon can still answer 503."""
    try:
        await gen.first_output()
    except asyncio.CancelledError:
        await record_turn(state, tenant, turn, gen.result)  # the client left: the turn is marked interrupted
        raise


async def chat_events(state: DaemonState, tenant: str, turn: Turn, gen: Generation, options: GenerationOptions,
                      rid: str, created: int, extra: dict) -> AsyncIterator[dict | str]:
    tok, model = state.loaded.tokenizer, state.model_id
    recorded = False
    try:
        yield fmt.chat_chunk(rid, created, model, {"role": "assistant", "content": ""})
        async for out in gen.outputs():
            logprobs = fmt.chat_logprobs(tok, out.logprobs) if options.params.logprobs else None
            finish = out.finish_reason.value if out.finished else None
            if out.text or logprobs or finish:
                yield fmt.chat_chunk(rid, created, model, {"content": out.text} if out.text else {}, finish, logprobs)
        # Stored before [DONE]: clients stop reading there and may send the next turn at once.
        recorded = True
        await record_turn(state, tenant, turn, gen.result)
        if options.include_usage:
            yield fmt.usage_chunk(rid, created, model, gen.result.usage(), gen.result.kvtierd_info(**extra),
                                  "chat.completion.chunk")
        yield "[DONE]"
    finally:
        if not recorded:
            # A client gone mid-stream leaves a turn marked interrupted, never a half-written one.
            await record_turn(state, tenant, turn, gen.result)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_completion(await read_json(request), state.settings.default_max_tokens)
    check_model(state, req.model)
    tok = state.loaded.tokenizer
    prompt_ids = req.prompt_ids if req.prompt_ids is not None else tok.encode(req.prompt_text)
    options = req.options
    qos_class = request_class(state.settings, request["tenant"], options.priority)
    gen = Generation(state.engine, prompt_ids, options.params, request["tenant"], tag=options.prefix_tag,
                     observer=state.metrics.observer(qos_class), qos_class=qos_class, workload=state.workload,
                     retention=options.retention)
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.model_id
    extra = {"priority": qos_class}
    if not options.stream:
        result = await gen.run()
        logprobs = fmt.completion_logprobs(tok, result.logprobs) if options.params.logprobs else None
        return web.json_response(fmt.text_completion(rid, created, model, result.text, result.finish_reason,
                                                     logprobs, result.usage(), result.kvtierd_info(**extra)))
    await gen.first_output()  # an overloaded daemon answers 503 before the stream starts
    return await serve_sse(request, state, completion_events(state, gen, options, rid, created, extra))


async def completion_events(state: DaemonState, gen: Generation, options: GenerationOptions, rid: str, created: int,
                            extra: dict) -> AsyncIterator[dict | str]:
    tok, model = state.loaded.tokenizer, state.model_id
    offset = 0
    async for out in gen.outputs():
        logprobs = fmt.completion_logprobs(tok, out.logprobs, offset) if options.params.logprobs else None
        offset += len(out.text)
        finish = out.finish_reason.value if out.finished else None
        if out.text or logprobs or finish:
            yield fmt.text_completion(rid, created, model, out.text, finish, logprobs, None, None)
    if options.include_usage:
        yield fmt.usage_chunk(rid, created, model, gen.result.usage(), gen.result.kvtierd_info(**extra),
                              "text_completion")
    yield "[DONE]"
