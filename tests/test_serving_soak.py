"""`hf-dynspec serve` as its users meet it, on a tiny model and its draft over loopback: the model goes by the name it
is served as, every malformed request of the serving page's table gets a 4xx naming its field, and a soak of
concurrent clients (streaming and not, leaving mid-answer, malformed requests among them) leaves no paged-cache
blocks behind, no growing memory, and the same greedy answers as before it. Needs transformers 5.25 or newer (served
names; the model in a process of its own)."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest
from test_serving import SERVER, draft_dir, free_port, model_dir, server  # noqa: F401 - fixtures

from hf_dynspec.evaluation.bad_requests import bad_requests, healthy, probe

NAME = "tiny-coder"
CONTEXT = 512  # the tiny model's max_position_embeddings
CACHES = re.compile(r"Paged caches: target (\d+) blocks held by (\d+) requests, draft (\d+) blocks held by (\d+)")
UNFINISHED = re.compile(r"(\d+) requests cancelled or failed")
GREEDY = [{"role": "user", "content": "w5 w6 w7 w5 w6 w7 w5"}]
KINDS = ("chat", "stream", "complete", "sampled", "leave-stream", "leave-waiting", "malformed")


@pytest.fixture(scope="module")
def served(model_dir, draft_dir, tmp_path_factory) -> Iterator[tuple[str, Path, int]]:  # noqa: F811 - fixtures
    """`hf-dynspec serve` on the tiny model as `tiny-coder`, drafting 3 tokens a step with the draft model (its own
    paged cache): its base URL, its log and its process id."""
    port = free_port()
    arguments = ["-m", "hf_dynspec.cli", "serve", model_dir, "--port", str(port), *SERVER, "--draft", draft_dir,
                 "--served-model-name", NAME, "--dynspec-config", '{"policy": "static", "num_speculative_tokens": 3}',
                 "--log-level", "info", "--stats-interval", "0.2"]
    with server(arguments, port, tmp_path_factory.mktemp("soak") / "server.log") as (log, process):
        yield f"http://localhost:{port}", log, process.pid


def client(url: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)


def greedy_answer(url: str) -> str:
    return client(url).chat.completions.create(model=NAME, messages=GREEDY, temperature=0, max_tokens=24).choices[
        0].message.content


@pytest.mark.slow
def test_the_model_goes_by_its_served_name(served, model_dir):  # noqa: F811 - fixture
    url, _, _ = served
    openai_client = client(url)
    assert [model.id for model in openai_client.models.list()] == [NAME]
    reply = openai_client.chat.completions.create(model=NAME, messages=GREEDY, temperature=0, max_tokens=4)
    chunks = openai_client.chat.completions.create(model=NAME, messages=GREEDY, max_tokens=4, stream=True)
    assert reply.model == NAME and {chunk.model for chunk in chunks} == {NAME}
    assert openai_client.completions.create(model=NAME, prompt="w5 w6", max_tokens=4).model == NAME
    with pytest.raises(openai.NotFoundError, match=f"serves `{NAME}`"):  # the folder it loads from is no name
        openai_client.chat.completions.create(model=model_dir, messages=GREEDY, max_tokens=4)


def test_every_malformed_request_gets_a_4xx_naming_its_field(served):
    url, _, _ = served
    requests = bad_requests(CONTEXT)
    answers = probe(url, NAME, requests)
    for request, answer in zip(requests, answers):
        assert 400 <= answer.status < 500, (request.name, answer)
        if request.field is not None:
            assert f"`{request.field}`" in answer.message, (request.name, answer)
    assert healthy(url) and greedy_answer(url)  # nothing it was sent stopped it


@pytest.mark.slow
def test_a_soak_leaves_no_blocks_no_growing_memory_and_the_same_greedy_answers(served):
    """Four rounds of 21 clients, 7 at a time, every kind of `KINDS` in each; after each round the caches hold no
    blocks (the server's stats line) and the server's memory is read. The first round warms the server up."""
    url, log, pid = served
    before = greedy_answer(url)
    outcomes, memory = [], []
    for round_index in range(4):
        seeds = [100 * round_index + index for index in range(21)]
        with ThreadPoolExecutor(max_workers=7) as pool:
            outcomes += pool.map(lambda index, seed: visit(url, index, random.Random(seed)), range(21), seeds)
        assert idle_caches(log) == (0, 0, 0, 0)
        memory.append(resident_mib(pid))
    assert not [outcome for outcome in outcomes if isinstance(outcome, int) and outcome >= 500]
    left = outcomes.count("left-stream")
    assert left >= 4 * 3 // 2 and int(UNFINISHED.findall(log.read_text())[-1]) >= left  # each left stream cancelled
    assert max(memory[1:]) - memory[1] <= max(16.0, 0.02 * memory[1]), memory
    assert greedy_answer(url) == before


def test_a_served_gguf_file_loads_dequantized(monkeypatch, tmp_path):
    """As the benchmarks load it: transformers' loader would keep its weights in GGUF blocks."""
    from transformers import GgufConfig
    from transformers.cli.serving.model_manager import ModelLoader

    from hf_dynspec.serving import SpeculatingLoader, Speculation

    asked = []
    monkeypatch.setattr(ModelLoader, "load_processor", lambda self, model_id: None)
    monkeypatch.setattr(ModelLoader, "_load_model", lambda self, model_id, **_: asked.append(
        (model_id, self.get_quantization_config())) or "model")
    monkeypatch.setattr(Speculation, "apply", lambda self, model: None)
    gguf = f"{tmp_path}:model-q8_0.gguf"
    loader = SpeculatingLoader.adopt(ModelLoader(device="cpu"), Speculation(2, None), {NAME: gguf})
    assert loader.load_model_and_processor(f"{NAME}@main") == ("model", None)
    assert loader.load_model_and_processor(str(tmp_path)) == ("model", None)
    (first, dequantized), (second, none) = asked
    assert first == gguf and isinstance(dequantized, GgufConfig) and dequantized.dequantize
    assert second == str(tmp_path) and none is None


def visit(url: str, index: int, rng: random.Random) -> int | str:
    """Client `index` of a round: a request of kind `KINDS[index % 7]` on a random prompt. Returns the answer's
    status, or how the client left."""
    kind = KINDS[index % len(KINDS)]
    messages = [{"role": "user", "content": " ".join(f"w{rng.randrange(3, 90)}" for _ in range(rng.randrange(2, 12)))}]
    tokens = rng.randrange(4, 40)
    try:
        if kind == "chat":
            client(url).chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=tokens)
        elif kind == "sampled":
            client(url).chat.completions.create(model=NAME, messages=messages, temperature=0.8, top_p=0.9,
                                                max_tokens=tokens, seed=index)
        elif kind == "complete":
            client(url).completions.create(model=NAME, prompt=messages[0]["content"], max_tokens=tokens)
        elif kind == "stream":
            for _ in client(url).chat.completions.create(model=NAME, messages=messages, max_tokens=tokens, stream=True):
                pass
        elif kind == "leave-stream":
            return leave_stream(url, messages, after=rng.randrange(2, 5))
        elif kind == "leave-waiting":  # a client that stops waiting for a long answer
            client(url, timeout=0.3).chat.completions.create(model=NAME, messages=messages, max_tokens=400)
        else:
            return probe(url, NAME, [rng.choice(bad_requests(CONTEXT))])[0].status
    except openai.APITimeoutError:
        return "left-waiting"
    except openai.APIStatusError as error:
        return error.status_code
    return 200


def leave_stream(url: str, messages: list[dict], after: int) -> int | str:
    """Stream a long answer and leave once `after` chunks with text came (the request is decoding by then); 200 if
    the answer ended first."""
    stream = client(url).chat.completions.create(model=NAME, messages=messages, max_tokens=400, stream=True)
    texts = 0
    for chunk in stream:
        texts += bool(chunk.choices and chunk.choices[0].delta.content)
        if texts >= after:
            stream.close()
            return "left-stream"
    return 200


def idle_caches(log: Path, timeout: float = 30) -> tuple[int, ...]:
    """The server's latest paged-cache line once no request holds blocks (within `timeout` s): target blocks and
    requests, draft blocks and requests."""
    deadline, latest = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        lines = CACHES.findall(log.read_text())
        latest = tuple(map(int, lines[-1])) if lines else None
        if latest == (0, 0, 0, 0):
            break
        time.sleep(0.2)
    return latest


def resident_mib(pid: int) -> float:
    """Resident memory of the server and its processes (the model's among them), in MiB."""
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / 2**20
