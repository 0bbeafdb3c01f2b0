"""Parsing and validating request bodies into typed requests.

Every check names the offending field (`param`) so the client's error says
what to fix. Unknown top-level fields are refused: a misspelt `max_token`
must not silently fall back to a default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvtierd.cache.retention import MAX_RETENTION_PRIORITY, MAX_RETENTION_S, Retention
from kvtierd.engine.errors import RequestError
from kvtierd.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from kvtierd.server.errors import bad_request

PRIORITIES = ("high", "normal", "low")
ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 4
TAG = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")

SAMPLING_FIELDS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                   "logprobs", "top_logprobs", "n", "user", "frequency_penalty", "presence_penalty",
                   "stream", "stream_options", "priority", "prefix_tag", "retention"}
CHAT_FIELDS = SAMPLING_FIELDS | {"model", "messages", "session_id"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"model", "prompt", "echo"}
SESSION_MESSAGE_FIELDS = SAMPLING_FIELDS | {"content"}
SESSION_CREATE_FIELDS = {"id", "system_prompt", "title", "priority"}
# A client-chosen session id: it appears in URL paths, so no slash; frontends' UUIDs and "chat-123" fit.
SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
SESSION_ID_RULE = "1-128 of A-Z a-z 0-9 . _ : -"


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: str | None  # as asked; None: the session's or the tenant's class (server/qos.py)
    prefix_tag: str | None = None  # marks the prompt's cached pages, e.g. "doc:v3", for invalidation
    retention: Retention | None = None  # keep its pages ahead of others in eviction for a while (soft; not a pin)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, str]]
    session_id: str | None
    options: GenerationOptions


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str | None
    prompt_text: str | None
    prompt_ids: list[int] | None
    options: GenerationOptions


def require_object(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}", param=unknown[0], code="unknown_field")
    return body


def _typed(body: dict, name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise bad_request(f"{name} must be {_kind_names(kinds)}, not a boolean", param=name)
    if not isinstance(value, kinds):
        raise bad_request(f"{name} must be {_kind_names(kinds)}", param=name)
    return value


def _kind_names(kinds: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array", dict: "an object"}
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(names.get(k, k.__name__) for k in kinds if not (k is int and float in kinds))


def parse_options(body: dict, default_max_tokens: int) -> GenerationOptions:
    n = _typed(body, "n", int, 1)
    if n != 1:
        raise bad_request("only n=1 is supported", param="n")
    for name in ("frequency_penalty", "presence_penalty"):
        if _typed(body, name, (int, float), 0) != 0:
            raise bad_request(f"{name} is not supported (only 0)", param=name)
    _typed(body, "user", str)
    max_tokens = _typed(body, "max_completion_tokens", int)  # `or` would turn a refused 0 into the default
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", int, default_max_tokens)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is None:
        stop = []
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("stop must be a string or an array of strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    logprobs = _typed(body, "logprobs", bool, False)
    top_logprobs = _typed(body, "top_logprobs", int, 0)
    if top_logprobs and not logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    stream_options = _typed(body, "stream_options", dict, {})
    stream = _typed(body, "stream", bool, False)
    if stream_options and not stream:
        raise bad_request("stream_options needs stream: true", param="stream_options")
    priority = _typed(body, "priority", str)
    if priority is not None and priority not in PRIORITIES:
        raise bad_request(f"priority must be one of {', '.join(PRIORITIES)}", param="priority")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_typed(body, "temperature", (int, float), 1.0)),
            top_p=float(_typed(body, "top_p", (int, float), 1.0)),
            top_k=_typed(body, "top_k", int, 0),
            seed=_typed(body, "seed", int),
            stop=tuple(stop),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
    except RequestError as e:
        raise bad_request(str(e), param=e.param) from e
    return GenerationOptions(params, stream, bool(stream_options.get("include_usage", False)), priority,
                             parse_tag(body.get("prefix_tag"), "prefix_tag"), parse_retention(body.get("retention")))


def parse_retention(value: Any) -> Retention | None:
    """`{"priority": 1-10, "duration_s": seconds}` (at most MAX_RETENTION_S)."""
    if value is None:
        return None
    rule = (f"retention must be {{\"priority\": 1-{MAX_RETENTION_PRIORITY}, \"duration_s\": seconds "
            f"(at most {MAX_RETENTION_S:g})}}")
    if not isinstance(value, dict) or set(value) != {"priority", "duration_s"}:
        raise bad_request(rule, param="retention")
    priority, duration = value["priority"], value["duration_s"]
    if isinstance(priority, bool) or not isinstance(priority, int) or isinstance(duration, bool) or \
            not isinstance(duration, (int, float)) or not 1 <= priority <= MAX_RETENTION_PRIORITY or \
            not 0 < duration <= MAX_RETENTION_S:
        raise bad_request(rule, param="retention")
    return Retention(priority, float(duration))


def parse_tag(value: Any, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not TAG.fullmatch(value):
        raise bad_request(f"{param} must be 1-128 of A-Z a-z 0-9 . _ : @ / - (e.g. doc:v3)", param=param)
    return value


def _message_content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text is understood
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts are supported", param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request("message content must be a string or an array of text parts", param=f"messages[{i}].content")


def parse_messages(value: Any, param: str = "messages") -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise bad_request(f"{param} must be an array", param=param)
    if not value:
        raise bad_request(f"{param} must not be empty", param=param)
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise bad_request("each message must be an object", param=f"{param}[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"role must be one of {', '.join(ROLES)}", param=f"{param}[{i}].role")
        out.append({"role": role, "content": _message_content(m.get("content"), i)})
    return out


def session_id_param(body: dict, name: str) -> str | None:
    """A session id the client names (to create or to use): None when absent."""
    value = _typed(body, name, str)
    if value is not None and not SESSION_ID.fullmatch(value):
        raise bad_request(f"{name} must be {SESSION_ID_RULE}", param=name)
    return value


def parse_chat(body: Any, default_max_tokens: int) -> ChatRequest:
    body = require_object(body, CHAT_FIELDS)
    return ChatRequest(
        model=_typed(body, "model", str),
        messages=parse_messages(body.get("messages")),
        session_id=session_id_param(body, "session_id"),
        options=parse_options(body, default_max_tokens),
    )


def parse_completion(body: Any, default_max_tokens: int) -> CompletionRequest:
    body = require_object(body, COMPLETION_FIELDS)
    if _typed(body, "echo", bool, False):
        raise bad_request("echo is not supported", param="echo")
    prompt = body.get("prompt")
    text, ids = None, None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        text = prompt[0]
    else:
        raise bad_request("prompt must be a string or an array of token ids (one prompt per request)", param="prompt")
    if text == "":
        raise bad_request("prompt must not be empty", param="prompt")
    count = body.get("logprobs")
    if isinstance(count, int) and not isinstance(count, bool):  # the legacy API: how many alternatives
        if not 0 <= count <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
        if body.get("top_logprobs") is not None:
            raise bad_request("give logprobs as a count or top_logprobs, not both", param="top_logprobs")
        body = {**body, "logprobs": True, "top_logprobs": count}
    return CompletionRequest(_typed(body, "model", str), text, ids, parse_options(body, default_max_tokens))
