"""Malformed requests to an OpenAI-compatible server, and what a server answers to each: the table of malformed
requests in the serving documentation, plain `transformers serve` beside `hf-dynspec serve`.

    python -m hf_dynspec.evaluation.bad_requests --plain http://localhost:8001 MODEL --ours http://localhost:8000 NAME

Each request is sent as its own POST (JSON, or a body that is not JSON), with the server's model named unless the
case names another; before each, the server is asked for its health, since one request can leave it unable to answer
others (an empty completion prompt stops plain `transformers serve`'s continuous-batching worker, and with it the
server): those requests come last.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from ..request_checks import CHAT, COMPLETIONS, RESPONSES

USER = [{"role": "user", "content": "w5 w6 w7"}]


@dataclass(frozen=True)
class BadRequest:
    """A malformed request: what it gets wrong, where it goes, its body (a string: sent as is) and the field a 4xx
    answer should name."""

    name: str
    endpoint: str
    body: dict[str, Any] | list | str
    field: str | None


def bad_requests(context_length: int | None = None) -> list[BadRequest]:
    """The malformed requests, with one whose `max_tokens` fits the context only without its prompt when
    `context_length` (the served model's, in tokens) is given."""
    chat = [
        ("`max_tokens` negative", {"messages": USER, "max_tokens": -5}, "max_tokens"),
        ("`max_tokens` zero", {"messages": USER, "max_tokens": 0}, "max_tokens"),
        ("`max_tokens` beyond any context", {"messages": USER, "max_tokens": 1_000_000_000}, "max_tokens"),
        ("`max_tokens` not an integer", {"messages": USER, "max_tokens": 2.5}, "max_tokens"),
        ("`max_completion_tokens` negative", {"messages": USER, "max_completion_tokens": -1}, "max_completion_tokens"),
        ("unknown `model`", {"messages": USER, "max_tokens": 4, "model": "no-such-model"}, "model"),
        ("`temperature` negative", {"messages": USER, "max_tokens": 4, "temperature": -1}, "temperature"),
        ("`temperature` above 2", {"messages": USER, "max_tokens": 4, "temperature": 5}, "temperature"),
        ("`temperature` a word", {"messages": USER, "max_tokens": 4, "temperature": "hot"}, "temperature"),
        ("`top_p` zero", {"messages": USER, "max_tokens": 4, "top_p": 0}, "top_p"),
        ("`top_p` above 1", {"messages": USER, "max_tokens": 4, "top_p": 1.5}, "top_p"),
        ("`messages` empty", {"messages": [], "max_tokens": 4}, "messages"),
        ("`messages` missing", {"max_tokens": 4}, "messages"),
        ("`messages` a string", {"messages": "w5 w6", "max_tokens": 4}, "messages"),
        ("a message not an object", {"messages": ["w5 w6"], "max_tokens": 4}, "messages[0]"),
        ("a message without `role`", {"messages": [{"content": "w5"}], "max_tokens": 4}, "messages[0].role"),
        ("a message with an unknown `role`", {"messages": [{"role": "wizard", "content": "w5"}], "max_tokens": 4},
         "messages[0].role"),
        ("a message's `content` a number", {"messages": [{"role": "user", "content": 5}], "max_tokens": 4},
         "messages[0].content"),
        ("a content part without `type`", {"messages": [{"role": "user", "content": [{"text": "w5"}]}],
                                            "max_tokens": 4}, "messages[0].content[0]"),
        ("`n` 2", {"messages": USER, "max_tokens": 4, "n": 2}, "n"),
        ("`n` 2, streamed", {"messages": USER, "max_tokens": 4, "n": 2, "stream": True}, "n"),
        ("`stream` a string", {"messages": USER, "max_tokens": 4, "stream": "yes"}, "stream"),
        ("`stop` a number", {"messages": USER, "max_tokens": 4, "stop": 5}, "stop"),
        ("`seed` a word", {"messages": USER, "max_tokens": 4, "seed": "x"}, "seed"),
        ("`logit_bias` keyed by a word", {"messages": USER, "max_tokens": 4, "logit_bias": {"x": 1}}, "logit_bias"),
        ("body not JSON", "{not json", None),
        ("body a list", [1, 2], None),
    ]
    if context_length is not None:
        chat.append(("`max_tokens` beyond the context with the prompt",
                     {"messages": USER, "max_tokens": context_length - 2}, "max_tokens"))
    completions = [
        ("`max_tokens` negative", {"prompt": "w5 w6", "max_tokens": -5}, "max_tokens"),
        ("`top_p` above 1", {"prompt": "w5 w6", "max_tokens": 4, "top_p": 2, "temperature": 1}, "top_p"),
        ("`n` 2", {"prompt": "w5 w6", "max_tokens": 4, "n": 2}, "n"),
    ]
    responses = [
        ("`input` missing", {"max_output_tokens": 4}, "input"),
        ("`max_output_tokens` negative", {"input": "w5 w6", "max_output_tokens": -5}, "max_output_tokens"),
    ]
    fatal = [(COMPLETIONS, "`prompt` missing", {"max_tokens": 4}, "prompt"),
             (COMPLETIONS, "`prompt` empty", {"prompt": "", "max_tokens": 4}, "prompt"),
             (RESPONSES, "`input` empty", {"input": "", "max_output_tokens": 4}, "input")]
    requests = [BadRequest(name, endpoint, body, field) for endpoint, cases in
                ((CHAT, chat), (COMPLETIONS, completions), (RESPONSES, responses)) for name, body, field in cases]
    return requests + [BadRequest(name, endpoint, body, field) for endpoint, name, body, field in fatal]


@dataclass(frozen=True)
class Answer:
    """A server's answer to a request: its HTTP status and the message it gave (its error's, or its start)."""

    status: int
    message: str


def send(base_url: str, model: str, request: BadRequest, timeout: float = 120) -> Answer:
    """POST `request` to the server at `base_url` (its model named `model`, unless the request names another)."""
    body = request.body
    if isinstance(body, dict) and "model" not in body:
        body = {"model": model, **body}
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    post = urllib.request.Request(base_url + request.endpoint, data=data, method="POST",
                                  headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(post, timeout=timeout) as response:
            return Answer(response.status, response.read().decode(errors="replace")[:200])
    except urllib.error.HTTPError as error:
        return Answer(error.code, error_message(error.read().decode(errors="replace")))


def error_message(text: str) -> str:
    """The message of an error answer: OpenAI's `error.message`, FastAPI's `detail`, or the text itself."""
    try:
        payload = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message"))
    if isinstance(payload, dict) and "detail" in payload:
        detail = payload["detail"]
        return detail if isinstance(detail, str) else "; ".join(str(item.get("msg", item)) for item in detail)
    if isinstance(payload, dict) and "error" in payload:
        return str(payload["error"])
    return text.strip()


def healthy(base_url: str, timeout: float = 10) -> bool:
    """Whether the server answers its health check with 200."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def probe(base_url: str, model: str, requests: list[BadRequest]) -> list[Answer]:
    """The server's answer to each request, in order; once it stops answering, `Answer(0, "no server")`."""
    answers = []
    for request in requests:
        if answers and not healthy(base_url):
            answers.append(Answer(0, "no server"))
            continue
        try:
            answers.append(send(base_url, model, request))
        except (urllib.error.URLError, OSError) as error:
            answers.append(Answer(0, f"no answer ({error})"))
    return answers


def table(requests: list[BadRequest], columns: dict[str, list[Answer]]) -> str:
    """Markdown: each request, the field at fault, and each server's status and message (`columns`: server name ->
    its answers)."""
    names = list(columns)
    lines = [f"| endpoint | request | field | {' | '.join(names)} |",
             "| --- | --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for index, request in enumerate(requests):
        cells = [_cell(columns[name][index]) for name in names]
        field = f"`{request.field}`" if request.field else "body"
        lines.append(f"| `{request.endpoint}` | {request.name} | {field} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _cell(answer: Answer) -> str:
    if answer.status == 0:
        return f"no answer: {answer.message}"
    if answer.status < 300:
        return f"{answer.status} (generates)"
    message = answer.message.replace("|", "\\|").replace("\n", " ")
    return f"{answer.status}: {message[:90] + '...' if len(message) > 90 else message}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", nargs=2, metavar=("URL", "MODEL"), help="plain `transformers serve` and its model")
    parser.add_argument("--ours", nargs=2, metavar=("URL", "MODEL"), help="`hf-dynspec serve` and its served name")
    parser.add_argument("--context-length", type=int, default=None, help="the served model's context, in tokens")
    args = parser.parse_args(argv)
    requests = bad_requests(args.context_length)
    columns = {label: probe(url, model, requests) for label, given in
               (("plain `transformers serve`", args.plain), ("`hf-dynspec serve`", args.ours)) if given
               for url, model in [given]}
    if not columns:
        parser.error("give --plain URL MODEL, --ours URL MODEL, or both")
    print(table(requests, columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
