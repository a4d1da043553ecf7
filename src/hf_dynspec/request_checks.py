"""What an OpenAI-compatible request to `hf-dynspec serve` may hold, checked before the request reaches transformers'
handlers: the first thing wrong, as a 4xx answer naming the field and what it takes.

transformers' server (5.25) converts a request's fields as it builds the generation settings: a value it cannot
convert becomes a 400, but a missing or malformed `messages` is a 500 (a `KeyError` or `TypeError` in its message
parsing), `max_tokens: -5` runs as if it asked for nothing, an empty completion prompt kills the continuous-batching
worker (every later request is a 503), and out-of-range sampling settings or `n: 2` are taken silently. vLLM's server
validates requests up front and answers 400 with the field named; `check_request` does the same for the fields of
`/v1/chat/completions`, `/v1/completions` and `/v1/responses`. Its answers carry OpenAI's error object
(`{"error": {"message", "type", "param", "code"}}`), which the `openai` client shows as the error's message.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
TOKEN_FIELDS = {CHAT: ("max_completion_tokens", "max_tokens"), COMPLETIONS: ("max_tokens",),
                RESPONSES: ("max_output_tokens",)}

REQUESTED_TOKENS: ContextVar[tuple[str, int] | None] = ContextVar("requested_tokens", default=None)
"""The answer length the request being handled asked for (its field and value), or `None` when it set none: the
served engine refuses an explicit length that does not fit the context, and shortens a default one."""


@dataclass(frozen=True)
class Limits:
    """What the server serves: the model names requests may give, and the longest a request may be, prompt and
    answer, in tokens (`None`: not known)."""

    served_names: tuple[str, ...]
    context_length: int | None = None


@dataclass(frozen=True)
class Problem:
    """What is wrong with a request: its HTTP status, the field (`param`) and a message saying what it takes."""

    status: int
    param: str | None
    message: str

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        kind = "invalid_request_error"
        code = "model_not_found" if self.status == 404 else None
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}


def check_request(endpoint: str, body: Any, limits: Limits) -> Problem | None:
    """The first problem of a request to `endpoint` (one of `ENDPOINTS`), or `None` if it can be served."""
    if not isinstance(body, dict):
        return Problem(400, None, f"The request body must be a JSON object, got {type(body).__name__}.")
    checks: list[Callable[[], Problem | None]] = [
        lambda: _check_model(body, limits),
        lambda: _check_input(endpoint, body),
        lambda: _check_lengths(endpoint, body, limits),
        lambda: _check_sampling(body),
        lambda: _check_choices(body),
        lambda: _check_stream(body),
        lambda: _check_stop(body),
    ]
    return next((problem for check in checks if (problem := check()) is not None), None)


def requested_tokens(endpoint: str, body: dict[str, Any]) -> tuple[str, int] | None:
    """The answer length a (checked) request asks for: its field and value, or `None`."""
    for name in TOKEN_FIELDS[endpoint]:
        if body.get(name) is not None:
            return name, body[name]
    return None


# ---- fields -------------------------------------------------------------------------------------------------------
def _check_model(body: dict[str, Any], limits: Limits) -> Problem | None:
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        return Problem(400, "model", f"`model` must be a string naming a served model, got {model!r}.")
    if model not in limits.served_names:
        served = ", ".join(f"`{name}`" for name in limits.served_names)
        return Problem(404, "model", f"`model` is `{model}`, which is not served here: this server serves {served} "
                                     "(see /v1/models).")
    return None


def _check_input(endpoint: str, body: dict[str, Any]) -> Problem | None:
    if endpoint == CHAT:
        return _check_messages(body.get("messages"))
    if endpoint == COMPLETIONS:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            return Problem(400, "prompt", f"`prompt` must be a non-empty string, got {_shown(prompt)}.")
        return None
    text = body.get("input")
    if not (isinstance(text, str) and text) and not (isinstance(text, list) and text):
        return Problem(400, "input", f"`input` must be a non-empty string or list of items, got {_shown(text)}.")
    return None


def _check_messages(messages: Any) -> Problem | None:
    if not isinstance(messages, list) or not messages:
        return Problem(400, "messages", f"`messages` must be a non-empty list of messages, got {_shown(messages)}.")
    for index, message in enumerate(messages):
        problem = _check_message(message, f"messages[{index}]")
        if problem is not None:
            return problem
    return None


def _check_message(message: Any, where: str) -> Problem | None:
    if not isinstance(message, dict):
        return Problem(400, where, f"`{where}` must be an object with `role` and `content`, got {_shown(message)}.")
    role = message.get("role")
    if role not in ROLES:
        return Problem(400, f"{where}.role", f"`{where}.role` must be one of {', '.join(ROLES)}, got {_shown(role)}.")
    content = message.get("content")
    if isinstance(content, str) or (content is None and (role == "assistant" and message.get("tool_calls"))):
        return None
    if not isinstance(content, list):
        return Problem(400, f"{where}.content", f"`{where}.content` must be a string or a list of content parts, "
                                                f"got {_shown(content)}.")
    for index, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            return Problem(400, f"{where}.content[{index}]", f"`{where}.content[{index}]` must be an object with a "
                                                             f"`type` (such as 'text'), got {_shown(part)}.")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            return Problem(400, f"{where}.content[{index}].text", f"`{where}.content[{index}].text` must be a "
                                                                  f"string, got {_shown(part.get('text'))}.")
    return None


def _check_lengths(endpoint: str, body: dict[str, Any], limits: Limits) -> Problem | None:
    for name in TOKEN_FIELDS[endpoint]:
        value = body.get(name)
        if value is None:
            continue
        if not _is_integer(value) or value < 1:
            return Problem(400, name, f"`{name}` must be a positive integer (the most tokens to generate), got "
                                      f"{_shown(value)}.")
        context = limits.context_length
        if context is not None and value >= context:
            return Problem(400, name, f"`{name}` is {value}, but the model takes at most {context} tokens, prompt "
                                      f"and answer: ask for fewer than {context}.")
    return None


def _check_sampling(body: dict[str, Any]) -> Problem | None:
    ranges = {"temperature": (0.0, 2.0, "between 0 and 2 (0: greedy)"),
              "top_p": (0.0, 1.0, "in (0, 1]"),
              "frequency_penalty": (-2.0, 2.0, "between -2 and 2"),
              "presence_penalty": (-2.0, 2.0, "between -2 and 2")}
    for name, (low, high, text) in ranges.items():
        value = body.get(name)
        if value is None:
            continue
        bad = not _is_number(value) or not low <= value <= high or (name == "top_p" and value == 0)
        if bad:
            return Problem(400, name, f"`{name}` must be a number {text}, got {_shown(value)}.")
    seed = body.get("seed")
    if seed is not None and not _is_integer(seed):
        return Problem(400, "seed", f"`seed` must be an integer, got {_shown(seed)}.")
    return _check_logit_bias(body.get("logit_bias"))


def _check_logit_bias(bias: Any) -> Problem | None:
    if bias is None:
        return None
    if isinstance(bias, dict) and all(
        isinstance(key, str) and key.isdigit() and _is_number(value) and -100 <= value <= 100
        for key, value in bias.items()
    ):
        return None
    return Problem(400, "logit_bias", "`logit_bias` must map token ids (as strings) to numbers between -100 and 100, "
                                      f"got {_shown(bias)}.")


def _check_choices(body: dict[str, Any]) -> Problem | None:
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is None or (value == 1 and _is_integer(value)):
            continue
        if not _is_integer(value) or value < 1:
            return Problem(400, name, f"`{name}` must be a positive integer, got {_shown(value)}.")
        return Problem(400, name, f"`{name}` is {value}, but this server answers one choice per request: send "
                                  f"{value} requests (or leave `{name}` out).")
    return None


def _check_stream(body: dict[str, Any]) -> Problem | None:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return Problem(400, "stream", f"`stream` must be true or false, got {_shown(stream)}.")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return Problem(400, "stream_options", f"`stream_options` must be an object, got {_shown(options)}.")
    return None


def _check_stop(body: dict[str, Any]) -> Problem | None:
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return None
    if isinstance(stop, list) and all(isinstance(item, str) and item for item in stop):
        return None
    return Problem(400, "stop", f"`stop` must be a string or a list of non-empty strings, got {_shown(stop)}.")


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value: Any) -> str:
    """A value as a message quotes it: JSON, cut short."""
    if value is None:
        return "nothing"
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- as ASGI middleware ---------------------------------------------------------------------------------------------
class RequestChecks:
    """ASGI middleware answering a POST to `ENDPOINTS` whose JSON body `check_request` finds a problem in, with the
    problem's status and OpenAI's error object; other requests pass on, their body replayed to the app. A body that
    is not JSON passes on too (the app answers it with 422). While a request is handled, `REQUESTED_TOKENS` holds the
    answer length it asked for."""

    def __init__(self, app: Any, limits: Limits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in ENDPOINTS:
            return await self.app(scope, receive, send)
        raw = await _read_body(receive)
        if raw is None:  # the client left before sending its body
            return None
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        problem = None if body is None else check_request(scope["path"], body, self.limits)
        if problem is not None:
            return await _answer(send, problem)
        checked = isinstance(body, dict)
        token = REQUESTED_TOKENS.set(requested_tokens(scope["path"], body) if checked else None)
        try:
            await self.app(scope, _replaying(raw, receive), send)
        finally:
            REQUESTED_TOKENS.reset(token)


async def _read_body(receive: Callable) -> bytes | None:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replaying(raw: bytes, receive: Callable) -> Callable:
    """A `receive` that gives the body read already, then what the client sends next (its disconnect)."""
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return replay


async def _answer(send: Callable, problem: Problem) -> None:
    payload = json.dumps(problem.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": problem.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
