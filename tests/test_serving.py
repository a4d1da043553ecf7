"""`hf-dynspec serve`: transformers' OpenAI-compatible server with speculation, checked with the `openai` client
against the same server without speculation (greedy, concurrent requests, streaming included)."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from conftest import perturbed, tiny_model, word_tokenizer
from transformers.cli.serve import Serve

from hf_dynspec import DynSpecConfig
from hf_dynspec.cli import build_parser
from hf_dynspec.commands.serve import serve_arguments
from hf_dynspec.continuous import SpeculativeManager
from hf_dynspec.serving import serve

PROMPTS = ["w5 w6 w7 w5 w6 w7 w5 w6", "w9 w9 w3 w4 w9 w9 w3", "w11 w12", "w20 w21 w22 w20 w21 w22 w20 w21 w22 w20"]
SERVER = {"continuous_batching": True, "device": "cpu", "dtype": "float64", "cb_num_blocks": 64,
          "cb_max_batch_tokens": 256, "non_blocking": True, "log_level": "error"}


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
def plain_answers(model_dir):
    """What plain `transformers serve` answers on the tiny model."""
    port = free_port()
    plain = Serve(force_model=model_dir, port=port, **SERVER)
    try:
        wait_until_listening(port)
        expected = ask_all(port, model_dir)
    finally:
        plain.kill_server()
    assert all(len(text.split()) > 10 for texts in expected.values() for text in texts)
    return expected


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def wait_until_listening(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("localhost", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"no server on port {port}")


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


def test_speculating_server_answers_as_the_plain_one(model_dir, plain_answers):
    port = free_port()
    config = DynSpecConfig(proposer="suffix", policy="static", suffix_min_token_probability=0.0, tree_node_budget=6)
    speculating = serve(model_dir, dynspec_config=config, port=port, **SERVER)  # suffix token trees
    try:
        wait_until_listening(port)
        first = ask_all(port, model_dir)
        again = ask_all(port, model_dir)  # drafts from the first round's outputs
        manager = speculating._generation_state._cb_manager._cb
    finally:
        speculating.kill_server()
    assert first == plain_answers and again == plain_answers
    assert isinstance(manager, SpeculativeManager)
    assert manager.speculation.requests == 2 * 3 * len(PROMPTS)
    assert manager.speculation.accepted_tokens > 0


def test_a_server_with_a_draft_model_answers_as_the_plain_one(model_dir, draft_dir, plain_answers):
    """Each request drafts each step from suffix trees or the draft model (`proposer="suffix"` with a draft)."""
    port = free_port()
    config = {"policy": "static", "proposer": "suffix"}
    speculating = serve(model_dir, assistant_model=draft_dir, dynspec_config=config, port=port, **SERVER)
    try:
        wait_until_listening(port)
        answers = ask_all(port, model_dir)
        manager = speculating._generation_state._cb_manager._cb
    finally:
        speculating.kill_server()
    assert answers == plain_answers
    assert isinstance(manager, SpeculativeManager)
    assert manager.speculator.proposer.model.dtype == torch.float64
    assert manager.speculation.accepted_tokens > 0
    assert manager.speculation.free_tokens < manager.speculation.draft_tokens  # the draft model drafted too


def test_serve_command_line_maps_to_transformers_serve_options():
    args = build_parser().parse_args(
        ["serve", "some/model", "--continuous-batching", "--proposer", "suffix", "--port", "8123",
         "--cb-num-blocks", "32", "--dynspec-config", '{"policy": "static", "num_speculative_tokens": 3}'])
    arguments = serve_arguments(args)
    config = arguments.pop("dynspec_config")
    assert config.proposer == "suffix" and config.policy == "static" and config.num_speculative_tokens == 3
    assert arguments == {"model": "some/model", "assistant_model": None, "prompt_lookup_num_tokens": None,
                         "continuous_batching": True, "port": 8123, "cb_num_blocks": 32, "device": "cpu"}
    command = ["serve", "--continuous-batching", "--draft", "qwen2.5-coder-0.5b", "--proposer", "hybrid"]
    pair = serve_arguments(build_parser().parse_args(command))
    assert pair["model"] == "qwen2.5-coder-1.5b" and pair["assistant_model"] == "qwen2.5-coder-0.5b"
    assert pair["dynspec_config"].proposer == "hybrid"


def test_serve_needs_a_proposer():
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=N"):
        serve("some/model")
    with pytest.raises(ValueError, match="positive integer"):
        serve("some/model", prompt_lookup_num_tokens=0)
