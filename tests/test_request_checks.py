"""Requests to `hf-dynspec serve` are checked before transformers' handlers: each malformed request of the serving
page's table gets a 4xx naming its field, well-formed ones pass untouched (the middleware replays their body)."""

from __future__ import annotations

import asyncio
import json

import pytest

from hf_dynspec.evaluation.bad_requests import bad_requests, error_message, table
from hf_dynspec.request_checks import (
    CHAT,
    COMPLETIONS,
    REQUESTED_TOKENS,
    RESPONSES,
    Limits,
    RequestChecks,
    check_request,
    requested_tokens,
)

LIMITS = Limits(("tiny-coder",), context_length=512)
USER = [{"role": "user", "content": "w5 w6"}]


def test_every_malformed_request_of_the_table_is_answered_with_its_field():
    """All but two: a body that is not JSON (the app answers 422) and a length that fits only without the prompt
    (the served engine refuses it once the prompt is tokenized)."""
    checked = 0
    for request in bad_requests(context_length=512):
        if isinstance(request.body, str):  # raw text: the middleware leaves it to the app
            continue
        body = {"model": "tiny-coder", **request.body} if isinstance(request.body, dict) else request.body
        if "with the prompt" in request.name:
            assert check_request(request.endpoint, body, LIMITS) is None
            continue
        problem = check_request(request.endpoint, body, LIMITS)
        assert problem is not None, request.name
        assert problem.param == request.field and 400 <= problem.status < 500, request.name
        if request.field is not None:
            assert f"`{request.field}`" in problem.message, (request.name, problem.message)
        checked += 1
    assert checked == len(bad_requests(512)) - 2


@pytest.mark.parametrize("endpoint, body", [
    (CHAT, {"model": "tiny-coder", "messages": USER, "max_tokens": 8, "temperature": 0, "top_p": 1, "n": 1,
            "stream": True, "stream_options": {"include_usage": True}, "stop": ["w9"], "seed": 3,
            "frequency_penalty": 0.5, "logit_bias": {"5": -100}}),
    (CHAT, {"messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": [
        {"type": "text", "text": "w5"}, {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}, {"role": "tool", "content": "w2"}]}),
    (CHAT, {"messages": USER, "max_completion_tokens": 511, "temperature": 2.0}),
    (COMPLETIONS, {"model": "tiny-coder", "prompt": "w5 w6", "max_tokens": 4, "stop": "w7", "best_of": 1}),
    (RESPONSES, {"input": [{"role": "user", "content": "w5"}], "max_output_tokens": 4}),
])
def test_well_formed_requests_pass(endpoint, body):
    assert check_request(endpoint, body, LIMITS) is None


def test_lengths_are_held_to_the_context_and_unknown_contexts_are_not():
    body = {"messages": USER, "max_tokens": 512}
    assert check_request(CHAT, body, LIMITS).message.endswith("ask for fewer than 512.")
    assert check_request(CHAT, body, Limits(("tiny-coder",))) is None
    assert check_request(CHAT, {**body, "max_tokens": True}, LIMITS).param == "max_tokens"  # a bool is no count
    assert requested_tokens(CHAT, {"max_tokens": 5, "max_completion_tokens": 7}) == ("max_completion_tokens", 7)
    assert requested_tokens(RESPONSES, {"input": "w5"}) is None


def test_an_unknown_model_is_a_404_naming_the_served_one():
    problem = check_request(CHAT, {"model": "/cache/gguf:model.gguf", "messages": USER}, LIMITS)
    assert problem.status == 404 and "`tiny-coder`" in problem.message
    assert problem.body()["error"] == {"message": problem.message, "type": "invalid_request_error", "param": "model",
                                       "code": "model_not_found"}


class Recorder:
    """An ASGI app that records the body it reads and the length `REQUESTED_TOKENS` held, and answers 200."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.requested: list = []

    async def __call__(self, scope, receive, send) -> None:
        self.bodies.append((await receive())["body"])
        self.requested.append(REQUESTED_TOKENS.get())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(app, path: str, body: bytes, method: str = "POST") -> list[dict]:
    """What `app` sends for one request of `body`, delivered in two chunks."""
    messages = [{"type": "http.request", "body": body[:3], "more_body": True},
                {"type": "http.request", "body": body[3:], "more_body": False}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app({"type": "http", "method": method, "path": path}, receive, send))
    return sent


def test_the_middleware_answers_problems_and_replays_good_bodies():
    inner = Recorder()
    app = RequestChecks(inner, LIMITS)
    good = json.dumps({"messages": USER, "max_tokens": 6}).encode()
    assert call(app, CHAT, good)[0]["status"] == 200
    assert inner.bodies == [good] and inner.requested == [("max_tokens", 6)]
    start, body = call(app, CHAT, json.dumps({"messages": USER, "max_tokens": -5}).encode())
    assert start["status"] == 400 and len(inner.bodies) == 1  # the app never saw it
    assert error_message(body["body"].decode()).startswith("`max_tokens` must be a positive integer")
    assert call(app, CHAT, b"{not json")[0]["status"] == 200  # left to the app, which answers 422
    assert call(app, "/v1/models", b"", method="GET")[0]["status"] == 200 and inner.requested[-1] is None


def test_the_table_puts_servers_side_by_side():
    from hf_dynspec.evaluation.bad_requests import Answer

    requests = bad_requests()[:2]
    text = table(requests, {"plain": [Answer(200, "{}"), Answer(500, "Internal Server Error")],
                            "ours": [Answer(400, "`max_tokens` must be | positive"), Answer(0, "no server")]})
    lines = text.splitlines()
    assert lines[0] == "| endpoint | request | field | plain | ours |" and len(lines) == 4
    assert lines[2].endswith("| 200 (generates) | 400: `max_tokens` must be \\| positive |")
    assert lines[3].endswith("| 500: Internal Server Error | no answer: no server |")
