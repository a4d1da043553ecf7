"""`hf-dynspec serve`: transformers' OpenAI-compatible server with speculation, checked with the `openai` client
against the same server without speculation (greedy, concurrent requests, streaming included)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import torch
from conftest import perturbed, tiny_model, word_tokenizer

from hf_dynspec.cli import build_parser
from hf_dynspec.commands.serve import serve_arguments
from hf_dynspec.serving import serve

PROMPTS = ["w5 w6 w7 w5 w6 w7 w5 w6", "w9 w9 w3 w4 w9 w9 w3", "w11 w12", "w20 w21 w22 w20 w21 w22 w20 w21 w22 w20"]
SERVER = ["--continuous-batching", "--device", "cpu", "--dtype", "float64", "--cb-num-blocks", "64",
          "--cb-max-batch-tokens", "256"]
STATS = re.compile(r"Speculation: (\d+) requests, (\d+) draft tokens \((\d+) model-free\), (\d+) accepted")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model and word tokenizer (with a chat template) saved where `transformers serve` can load them."""
    folder = tmp_path_factory.mktemp("tiny-served")
    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    tiny_model("llama", seed=0, dtype=torch.float64).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A draft for the tiny model: its weights with noise, saved where the server can load it."""
    folder = tmp_path_factory.mktemp("tiny-draft")
    perturbed(tiny_model("llama", seed=0, dtype=torch.float64), scale=0.1, seed=3).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def plain_answers(model_dir, tmp_path_factory):
    """What plain `transformers serve` answers on the tiny model."""
    port = free_port()
    command = ["-m", "transformers.cli.transformers", "serve", model_dir, "--port", str(port), *SERVER,
               "--log-level", "error"]
    with server(command, port, tmp_path_factory.mktemp("plain") / "server.log"):
        expected = ask_all(port, model_dir)
    assert all(len(text.split()) > 10 for texts in expected.values() for text in texts)
    return expected


@contextmanager
def server(arguments: list[str], port: int, log: Path) -> Iterator[tuple[Path, subprocess.Popen]]:
    """A server run as its command line runs it (`python ARGUMENTS`), listening on `port`, its output in `log`:
    the log and the process; stopped (SIGTERM, as a service manager stops it) on leaving."""
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, *arguments], stdout=output, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        wait_until_listening(port, process, log)
        yield log, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def speculating(model_dir: str, port: int, *options: str) -> list[str]:
    """`hf-dynspec serve` on the tiny model, logging what speculation did every 0.2 s."""
    return ["-m", "hf_dynspec.cli", "serve", model_dir, "--port", str(port), *SERVER, *options,
            "--log-level", "info", "--stats-interval", "0.2"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def wait_until_listening(port: int, process: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        with socket.socket() as probe:
            if probe.connect_ex(("localhost", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"no server on port {port}:\n{log.read_text()[-3000:]}")


def speculation_stats(log: Path, requests: int, timeout: float = 30) -> dict[str, int]:
    """The figures of the server's latest speculation line, once it counts `requests` requests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = STATS.findall(log.read_text())
        if lines and int(lines[-1][0]) >= requests:
            return dict(zip(("requests", "draft", "free", "accepted"), map(int, lines[-1])))
        time.sleep(0.2)
    raise AssertionError(f"no speculation line counting {requests} requests:\n{log.read_text()[-3000:]}")


def ask_all(port: int, model: str) -> dict[str, list[str]]:
    """Every prompt at once (concurrent requests share the continuous batch): chat completions, streamed chat
    completions and completions, greedy."""
    client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="none")

    def chat(prompt: str) -> str:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=40)
        return reply.choices[0].message.content

    def streamed(prompt: str) -> str:
        chunks = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=40, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)

    def complete(prompt: str) -> str:
        return client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=40).choices[0].text

    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        return {name: list(pool.map(ask, PROMPTS)) for name, ask in
                (("chat", chat), ("streamed", streamed), ("completions", complete))}


@pytest.mark.slow
def test_speculating_server_answers_as_the_plain_one(model_dir, plain_answers, tmp_path):
    port = free_port()
    config = {"proposer": "suffix", "policy": "static", "suffix_min_token_probability": 0.0, "tree_node_budget": 6}
    arguments = speculating(model_dir, port, "--dynspec-config", json.dumps(config))  # suffix token trees
    with server(arguments, port, tmp_path / "server.log") as (log, _):
        first = ask_all(port, model_dir)
        again = ask_all(port, model_dir)  # drafts from the first round's outputs
        stats = speculation_stats(log, 2 * 3 * len(PROMPTS))
        client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="`max_tokens` must be a positive integer"):
            client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": "w5"}], max_tokens=-5)
    assert first == plain_answers and again == plain_answers
    assert stats["requests"] == 2 * 3 * len(PROMPTS)
    assert stats["accepted"] > 0 and stats["free"] == stats["draft"]


@pytest.mark.slow
def test_a_server_with_a_draft_model_answers_as_the_plain_one(model_dir, draft_dir, plain_answers, tmp_path):
    """Each request drafts each step from suffix trees or the draft model (`--proposer suffix` with a draft)."""
    port = free_port()
    arguments = speculating(model_dir, port, "--draft", draft_dir, "--proposer", "suffix",
                            "--dynspec-config", '{"policy": "static"}')
    with server(arguments, port, tmp_path / "server.log") as (log, _):
        answers = ask_all(port, model_dir)
        stats = speculation_stats(log, 3 * len(PROMPTS))
    assert answers == plain_answers
    assert stats["accepted"] > 0
    assert stats["free"] < stats["draft"]  # the draft model drafted too


def test_serve_command_line_maps_to_transformers_serve_options():
    args = build_parser().parse_args(
        ["serve", "some/model", "--continuous-batching", "--proposer", "suffix", "--port", "8123",
         "--cb-num-blocks", "32", "--dynspec-config", '{"policy": "static", "num_speculative_tokens": 3}'])
    arguments = serve_arguments(args)
    config = arguments.pop("dynspec_config")
    assert config.proposer == "suffix" and config.policy == "static" and config.num_speculative_tokens == 3
    assert arguments == {"model": "some/model", "assistant_model": None, "prompt_lookup_num_tokens": None,
                         "continuous_batching": True, "stats_interval": 10.0, "served_model_name": None, "port": 8123,
                         "cb_num_blocks": 32,
                         "device": "cpu"}
    command = ["serve", "--continuous-batching", "--draft", "qwen2.5-coder-0.5b", "--proposer", "hybrid",
               "--served-model-name", "coder"]
    pair = serve_arguments(build_parser().parse_args(command))
    assert pair["model"] == "qwen2.5-coder-1.5b" and pair["assistant_model"] == "qwen2.5-coder-0.5b"
    assert pair["served_model_name"] == "coder"
    assert pair["dynspec_config"].proposer == "hybrid"


def test_serve_needs_a_proposer():
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=N"):
        serve("some/model")
    with pytest.raises(ValueError, match="positive integer"):
        serve("some/model", prompt_lookup_num_tokens=0)
    with pytest.raises(ValueError, match="stats_interval"):
        serve("some/model", prompt_lookup_num_tokens=2, stats_interval=0)
    with pytest.raises(ValueError, match="served_model_name"):
        serve("some/model", prompt_lookup_num_tokens=2, served_model_name=" ")


def test_a_registry_draft_loads_with_its_variant_in_the_served_dtype(monkeypatch):
    """`--draft qwen2.5-coder-0.5b@4bit`: the registry's draft, 4-bit, computing in the served model's dtype and
    placed on its device as it loads; a bare registry name keeps full precision."""
    from hf_dynspec.evaluation import models
    from hf_dynspec.serving import load_draft

    loaded = []
    monkeypatch.setattr(models, "resolve_model", lambda name: f"resolved {name}")  # no weights fetched
    monkeypatch.setattr(models, "load_model", lambda location, options: loaded.append((location, options)) or "draft")
    served = tiny_model("llama", seed=0, dtype=torch.bfloat16)
    assert load_draft("qwen2.5-coder-0.5b@4bit", served) == "draft"
    assert load_draft("qwen2.5-coder-0.5b", served) == "draft"
    (quantized_at, quantized), (plain_at, plain) = loaded
    assert quantized_at == plain_at == "resolved qwen2.5-coder-0.5b"
    assert (quantized.quantization, quantized.dtype, quantized.device) == ("4bit", "bfloat16", "cpu")
    assert (plain.quantization, plain.dtype) == ("none", "bfloat16")
    with pytest.raises(ValueError, match="Unknown variant"):
        load_draft("qwen2.5-coder-0.5b@3bit", served)
