"""The serve scenario through servers (`hf-dynspec bench --scenario serve --through server`): the same requests sent to
plain `transformers serve --continuous-batching` and to `hf-dynspec serve`, as their users send them.

Each method runs as a server started from its command line, on loopback: `cb-plain` as plain `transformers serve`, the
others as `hf-dynspec serve` with the method's proposer, policy and lengths. Both load the same weights from a folder:
the tiny pair, or the registry target's GGUF weights dequantized once to the bench's dtype (neither server then keeps
GGUF blocks packed), with the registry's end-of-sequence tokens. Every request is a greedy streamed completion
(`/v1/completions`, `stream_options.include_usage`) of the prompt's text through the `openai` client; per request:
latency from sending to the last token, time to first token, time per output token after the first (over the
server's count of generated tokens), and per run output tokens per second. A speculating server's stats lines give
what it drafted and accepted in the run, and its seconds in forwards and drafting.

First the same requests go all at once through every path a user has (`burst_rows`, then each server): `generate` on one padded batch,
continuous batching in the process (the engine `generate_batch` runs) and the server, each plain and speculating: that
table says what continuous batching and the server cost on the machine, and what speculation adds on each path. Then
the rates of the serve scenario, on one arrival trace per rate, the same for every server.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .serve import ServeMethod, arrival_times, run_trace, summarize

SPECULATION = re.compile(
    r"Speculation: (\d+) requests, (\d+) draft tokens \((\d+) model-free\), (\d+) accepted .*?, "
    r"([\d.]+) s in forwards, ([\d.]+) s drafting"
)
CACHES = re.compile(r"Paged caches: target (\d+) blocks held by (\d+) requests(?:, draft (\d+) blocks held by (\d+))?")
STATS_INTERVAL = 0.25  # seconds between a speculating server's stats lines


@dataclass(frozen=True)
class ServedWeights:
    """What the servers load: the target's folder, the draft as `--draft` takes it, the dtype and device, and the
    prompts as text."""

    target: str
    draft: str | None
    dtype: str
    device: str
    texts: list[str]


# ---- the weights and prompts the servers take -------------------------------------------------------------------
def served_weights(settings: Any, prompts: list[list[int]], folder: Path) -> ServedWeights:
    """The bench's target (and draft) as servers load them, written under `folder` where needed, and its prompts as
    text. The in-process paths take `tokenize(settings, texts)`, the ids the servers' tokenizer gives those texts."""
    if settings.tiny:
        return _tiny_weights(settings, prompts, folder)
    from .models import dequantized_checkpoint, load_tokenizer, resolve_dtype, resolve_model

    name, options = settings.load_options("target")
    location = resolve_model(name)
    dtype = resolve_dtype(options.dtype, location, options.device)
    checkpoint = Path(dequantized_checkpoint(location, dtype).path)
    target = _with_eos(checkpoint, location.eos_token_ids, folder / "target")
    texts = [load_tokenizer(location).decode(prompt) for prompt in prompts]
    return ServedWeights(str(target), settings.draft, str(dtype).removeprefix("torch."), str(options.device), texts)


def _with_eos(checkpoint: Path, eos_token_ids: tuple[int, ...], folder: Path) -> Path:
    """`checkpoint` seen through `folder` (links to its files) with `eos_token_ids` as its generation config's end of
    sequence, as the bench loads registry models; `checkpoint` itself when there are none."""
    if not eos_token_ids:
        return checkpoint
    folder.mkdir(parents=True, exist_ok=True)
    for source in checkpoint.iterdir():
        if source.name != "generation_config.json" and not (folder / source.name).exists():
            (folder / source.name).symlink_to(source.resolve())
    config_file = checkpoint / "generation_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": list(eos_token_ids)}))
    return folder


def _tiny_weights(settings: Any, prompts: list[list[int]], folder: Path) -> ServedWeights:
    """The tiny pair the bench builds, saved with a word tokenizer (`w<id>` for each id)."""
    from .tiny import TINY_VOCAB, tiny_pair

    dtype = settings.dtype if settings.dtype != "auto" else "float32"
    for role, model in zip(("target", "draft"), tiny_pair(settings.seed)):
        model.to(getattr(torch, dtype)).save_pretrained(folder / role)
    tiny_tokenizer(TINY_VOCAB).save_pretrained(folder / "target")
    texts = [" ".join(f"w{token}" for token in prompt) for prompt in prompts]
    return ServedWeights(str(folder / "target"), str(folder / "draft"), dtype, "cpu", texts)


def tiny_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer for the tiny pair: id 0 is `<pad>`, 1 `</s>`, every other id `w<id>`."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from .tiny import TINY_EOS, TINY_PAD

    words = {"<pad>": TINY_PAD, "</s>": TINY_EOS} | {f"w{i}": i for i in range(vocab) if i not in (TINY_PAD, TINY_EOS)}
    backend = Tokenizer(WordLevel(words, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", padding_side="left")


def tokenize(weights: ServedWeights, texts: list[str]) -> list[list[int]]:
    """The ids the servers' tokenizer gives `texts` (what a completion request's prompt becomes)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(weights.target)
    return [tokenizer(text)["input_ids"] for text in texts]


# ---- servers -------------------------------------------------------------------------------------------------------
def server_arguments(method: ServeMethod, weights: ServedWeights, cb_config: dict[str, Any]) -> list[str]:
    """`python` arguments that serve `weights` as `method` does (without `--port`)."""
    common = ["--continuous-batching", "--device", weights.device, "--dtype", weights.dtype,
              "--cb-block-size", str(cb_config["page_size"]), "--cb-num-blocks", str(cb_config["num_blocks"]),
              "--cb-max-batch-tokens", str(cb_config["max_batch_tokens"]), "--log-level", "info"]
    if method.proposer is None:
        return ["-m", "transformers.cli.transformers", "serve", weights.target, *common]
    flags = ["--dynspec-config", json.dumps(method.dynspec_config()), "--stats-interval", str(STATS_INTERVAL)]
    if method.needs_draft:
        flags += ["--draft", weights.draft]
    if method.proposer == "lookup":
        flags += ["--prompt-lookup-num-tokens", str(method.tokens)]
    return ["-m", "hf_dynspec.cli", "serve", weights.target, *common, *flags]


@contextmanager
def running_server(arguments: list[str], log: Path, timeout: float = 900) -> Iterator[str]:
    """A server run as `python ARGUMENTS --port PORT` (a free port), its output in `log`, listening within `timeout`
    seconds: its base URL. Stopped with SIGTERM on leaving."""
    port = _free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, *arguments, "--port", str(port)], stdout=output,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_until_listening(port, process, log, timeout)
        yield f"http://localhost:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _wait_until_listening(port: int, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"The server exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        with socket.socket() as probe:
            if probe.connect_ex(("localhost", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"No server on port {port} after {timeout} s:\n{log.read_text()[-3000:]}")


# ---- requests --------------------------------------------------------------------------------------------------------
def http_trace(url: str, model: str, texts: list[str], arrivals: list[float], max_new_tokens: int) -> dict[str, Any]:
    """Send `texts[i]` at `arrivals[i]` seconds as a streamed greedy completion; per request its text, generated
    tokens, latency, TTFT and TPOT, and the run's output tokens per second."""
    if len(texts) != len(arrivals):
        raise ValueError(f"{len(texts)} prompts and {len(arrivals)} arrival times: give one arrival per prompt.")
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(texts)) as pool:
        requests = list(pool.map(lambda text, arrival: _streamed(url, model, text, max_new_tokens, start + arrival),
                                 texts, arrivals))
    end = max(request.pop("end") for request in requests)
    return {"requests": requests, "tokens_per_s": sum(r["generated"] for r in requests) / (end - start)}


def _streamed(url: str, model: str, text: str, max_new_tokens: int, at: float) -> dict[str, Any]:
    import openai

    time.sleep(max(0.0, at - time.perf_counter()))
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    sent = time.perf_counter()
    stream = client.completions.create(model=model, prompt=text, max_tokens=max_new_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    stamps, pieces, generated = [], [], 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
            pieces.append(chunk.choices[0].text)
        if getattr(chunk, "usage", None) is not None:
            generated = chunk.usage.completion_tokens
    end = stamps[-1] if stamps else time.perf_counter()
    tpot = (stamps[-1] - stamps[0]) / (generated - 1) if len(stamps) > 1 and generated > 1 else None
    return {"text": "".join(pieces), "generated": generated, "latency_s": end - sent,
            "ttft_s": stamps[0] - sent if stamps else None, "tpot_s": tpot, "end": end}


def speculation_totals(log: Path, timeout: float = 60) -> dict[str, float]:
    """What a speculating server's latest stats line counts once its lines have settled (the same twice, two
    intervals apart, with no request holding blocks): requests, draft tokens (model-free among them), accepted
    tokens, seconds in forwards and drafting. All zero for a server without such lines (plain)."""
    names = ("requests", "draft_tokens", "free_tokens", "accepted_tokens", "forward_seconds", "draft_seconds")
    deadline, previous = time.monotonic() + timeout, None
    while True:
        text = log.read_text()
        lines, caches = SPECULATION.findall(text), CACHES.findall(text)
        if not lines:
            return dict.fromkeys(names, 0.0)
        current = (lines[-1], bool(caches) and not any(int(blocks or 0) for blocks in caches[-1]))
        if (current == previous and current[1]) or time.monotonic() > deadline:
            return {name: float(value) for name, value in zip(names, current[0])}
        previous = current
        time.sleep(2 * STATS_INTERVAL)


def _difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before[name], 3) for name in after}


# ---- the bench -------------------------------------------------------------------------------------------------------
def run_serve_through_servers(settings: Any, folder: Path, progress: bool = True) -> dict[str, Any]:
    """The same requests at once through every path (`burst_rows` in the process, then each server's burst), then
    every method's server at every rate (requests/s, or `"<share>x"` of the plain server's capacity in the burst),
    `repetitions` times, on one arrival trace per rate. One server per method, started once."""
    from dataclasses import asdict

    from .bench import load_inputs, machine_description
    from .serve import arrival_rates, cb_config_for

    methods = [ServeMethod.parse(name) for name in settings.methods.split(",") if name]
    methods = [ServeMethod.parse("cb-plain")] + [m for m in methods if m.proposer is not None]
    model, draft, prompts = load_inputs(settings, need_draft=any(m.needs_draft for m in methods))
    weights = served_weights(settings, prompts, folder / "weights")
    prompts = tokenize(weights, weights.texts)
    cb_config = cb_config_for(prompts, settings.max_new_tokens)
    rows = burst_rows(model, draft, prompts, methods[:2], settings.max_new_tokens, cb_config)
    reference, rates, runs = _texts(weights, rows[0]["tokens"]), [], []
    for method in methods:
        with running_server(server_arguments(method, weights, cb_config), folder / f"{_slug(method.name)}.log") as url:
            log = folder / f"{_slug(method.name)}.log"
            http_trace(url, weights.target, weights.texts[:1], [0.0], 4)  # warm-up
            if method in methods[:2]:
                rows.append(_server_row(method, url, log, weights, settings.max_new_tokens, reference))
            if not rates:  # the plain server's capacity: every request at once
                capacity = len(prompts) / rows[-1]["seconds"]
                rates = arrival_rates(settings.rates, capacity)
            runs += _method_runs(method, url, log, weights, rates, settings)
    config = {key: value for key, value in asdict(settings).items() if key != "loaded_models"}
    return {"config": {**config, "through": "server", "continuous_batching": cb_config,
                       "prompt_tokens": [len(p) for p in prompts]},
            "machine": machine_description(), "models": settings.loaded_models,
            "burst": [{k: v for k, v in row.items() if k != "tokens"} for row in rows],
            "capacity_requests_per_s": capacity, "rates": rates, "runs": runs,
            "summary": _summary(runs, methods, rates), "same_text_as_plain": same_text(runs)}


def _method_runs(method: ServeMethod, url: str, log: Path, weights: ServedWeights, rates: list[float],
                 settings: Any) -> list[dict[str, Any]]:
    """Each rate's trace `repetitions` times on `method`'s server, with the speculation each run added to its
    counts."""
    runs = []
    for rep in range(settings.repetitions):
        for rate in rates:
            arrivals = arrival_times(len(weights.texts), rate, settings.seed + rates.index(rate))
            before = speculation_totals(log)
            run = http_trace(url, weights.target, weights.texts, arrivals, settings.max_new_tokens)
            run["speculation"] = _difference(speculation_totals(log), before)
            runs.append({"method": method.name, "rate": rate, "repetition": rep, **run})
    return runs


def burst_rows(model: torch.nn.Module, draft: Any, prompts: list[list[int]], methods: list[ServeMethod],
               max_new_tokens: int, cb_config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every prompt at once through `generate` (one padded batch) and continuous batching in the process, each with
    every method of `methods` (plain first): per path and method, seconds to the last token, generated tokens,
    tokens per second, draft and accepted tokens, and how many requests have plain `generate`'s tokens."""
    from transformers import ContinuousBatchingConfig

    config = copy.deepcopy(model.generation_config)
    config.update(do_sample=False, max_new_tokens=max_new_tokens, temperature=None, top_p=None, top_k=None,
                  return_dict_in_generate=True)
    rows = [_generate_row(model, prompts, config, method, draft) for method in methods]
    for method in methods:
        manager = method.manager(model, config, ContinuousBatchingConfig(**cb_config), draft)
        try:
            run = run_trace(manager, prompts, [0.0] * len(prompts), max_new_tokens)
        finally:
            manager.stop(block=True)
        rows.append(_row("continuous batching", method, run, getattr(manager, "speculation", None)))
    for row in rows:
        row["same_as_generate"] = sum(a == b for a, b in zip(row["tokens"], rows[0]["tokens"]))
    return rows


def _generate_row(model: torch.nn.Module, prompts: list[list[int]], config: Any, method: ServeMethod,
                  draft: Any) -> dict[str, Any]:
    """`generate` on one left-padded batch of `prompts`: plain, or `hf_dynspec.generate` as `method` speculates."""
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    start = time.perf_counter()
    with torch.no_grad():
        if method.proposer is None:
            output = model.generate(ids, attention_mask=mask, generation_config=config)
        else:
            from ..integration import generate

            speculation = {key: value for key, value in method.speculation(draft).items() if value is not None}
            output = generate(model, ids, attention_mask=mask, generation_config=config, **speculation)
    seconds = time.perf_counter() - start
    tokens = [_until_eos(row[width:].tolist(), config.eos_token_id) for row in output.sequences]
    stats = getattr(output, "dynspec_stats", None)
    return {"path": "generate", "method": method.name, "seconds": seconds, "generated": sum(map(len, tokens)),
            "tokens_per_s": sum(map(len, tokens)) / seconds, "draft_tokens": stats.draft_tokens if stats else 0,
            "accepted_tokens": stats.accepted_tokens if stats else 0, "tokens": tokens}


def _until_eos(tokens: list[int], eos: int | list[int] | None) -> list[int]:
    """`tokens` up to and with the first end-of-sequence token (what a request generates)."""
    ends = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return next((tokens[: i + 1] for i, token in enumerate(tokens) if token in ends), tokens)


def _row(path: str, method: ServeMethod, run: dict[str, Any], stats: Any) -> dict[str, Any]:
    """A burst row of an in-process run (`run_trace`)."""
    tokens = [request["tokens"] for request in run["requests"]]
    seconds = max(request["latency_s"] for request in run["requests"])
    return {"path": path, "method": method.name, "seconds": seconds, "generated": sum(map(len, tokens)),
            "tokens_per_s": sum(map(len, tokens)) / seconds,
            "draft_tokens": stats.draft_tokens if stats else 0, "accepted_tokens": stats.accepted_tokens if stats else 0,
            "forward_seconds": stats.forward_seconds if stats else None,
            "draft_seconds": stats.draft_seconds if stats else None, "tokens": tokens}


def _server_row(method: ServeMethod, url: str, log: Path, weights: ServedWeights, max_new_tokens: int,
                reference: list[str]) -> dict[str, Any]:
    """A burst row of a server: every prompt sent at once; `reference`: plain `generate`'s texts."""
    before = speculation_totals(log)
    run = http_trace(url, weights.target, weights.texts, [0.0] * len(weights.texts), max_new_tokens)
    stats = _difference(speculation_totals(log), before)
    seconds = max(request["latency_s"] for request in run["requests"])
    generated = sum(request["generated"] for request in run["requests"])
    texts = [request["text"] for request in run["requests"]]
    return {"path": "server", "method": method.name, "seconds": seconds, "generated": generated,
            "tokens_per_s": generated / seconds, "draft_tokens": int(stats["draft_tokens"]),
            "accepted_tokens": int(stats["accepted_tokens"]),
            **{key: stats[key] if method.proposer is not None else None for key in ("forward_seconds", "draft_seconds")},
            "same_as_generate": sum(a == b for a, b in zip(texts, reference))}


def _texts(weights: ServedWeights, tokens: list[list[int]]) -> list[str]:
    """What a server's completions would read for `tokens` (special tokens left out)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(weights.target)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in tokens]


def same_text(runs: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per method: its requests whose text is the plain server's in the same rate and repetition, and the others."""
    plain = {(r["rate"], r["repetition"]): r for r in runs if r["method"] == "cb-plain"}
    counts: dict[str, dict[str, int]] = {}
    for run in runs:
        reference = plain[(run["rate"], run["repetition"])]["requests"]
        same = sum(a["text"] == b["text"] for a, b in zip(run["requests"], reference))
        total = counts.setdefault(run["method"], {"same": 0, "different": 0})
        total["same"] += same
        total["different"] += len(reference) - same
    return counts


def _summary(runs: list[dict[str, Any]], methods: list[ServeMethod], rates: list[float]) -> list[dict[str, Any]]:
    """Per (method, rate): the median over repetitions of each run's means, and the draft and accepted tokens."""
    import statistics

    rows = []
    for rate in rates:
        for method in methods:
            mine = [r for r in runs if r["method"] == method.name and r["rate"] == rate]
            means = [summarize(r) for r in mine]
            rows.append({"method": method.name, "rate": rate,
                         **{key: statistics.median(m[key] for m in means) for key in means[0]},
                         **{key: statistics.median(r["speculation"][key] for r in mine)
                            for key in ("draft_tokens", "accepted_tokens", "forward_seconds", "draft_seconds")}})
    return rows


def _slug(name: str) -> str:
    return re.sub(r"[^\w.+-]", "_", name)


def burst_table(results: dict[str, Any]) -> str:
    """Markdown: the same requests at once through each path, plain and speculating."""
    count = len(results["config"]["prompt_tokens"])
    lines = [f"The same {count} requests at once, {results['config']['max_new_tokens']} new tokens at most:", "",
             "| path | method | seconds | tokens | tokens/s | draft tokens | accepted | s in forwards | s drafting | "
             "same as generate |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in results["burst"]:
        forwards, drafting = (_seconds(row.get(key)) for key in ("forward_seconds", "draft_seconds"))
        lines.append(f"| {row['path']} | {row['method']} | {row['seconds']:.2f} | {row['generated']} | "
                     f"{row['tokens_per_s']:.1f} | {row['draft_tokens']} | {row['accepted_tokens']} | {forwards} | "
                     f"{drafting} | {row['same_as_generate']}/{count} |")
    lines += ["", "Seconds in forwards and drafting: what a speculating manager's steps spent (its stats line, for a "
                  "server); the rest of a run is scheduling, the server's HTTP and tokenizing, and waiting."]
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def server_table(results: dict[str, Any]) -> str:
    """Markdown: per rate and method, through the servers: latency, TTFT, TPOT, tokens/s, draft and accepted tokens."""
    lines = [f"Through the servers (plain capacity {results['capacity_requests_per_s']:.3f} requests/s in the burst; "
             "medians of the repetitions):", "",
             "| rate (req/s) | method | mean latency s | TTFT s | TPOT ms | tokens/s | draft tokens | accepted | "
             "s in forwards | s drafting |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in results["summary"]:
        plain = row["method"] == "cb-plain"
        forwards, drafting = (_seconds(None if plain else row[key]) for key in ("forward_seconds", "draft_seconds"))
        lines.append(f"| {row['rate']:.3f} | {row['method']} | {row['latency_s']:.2f} | {row['ttft_s']:.2f} | "
                     f"{1000 * row['tpot_s']:.0f} | {row['tokens_per_s']:.2f} | {row['draft_tokens']:.0f} | "
                     f"{row['accepted_tokens']:.0f} | {forwards} | {drafting} |")
    same = ", ".join(f"{name} {c['same']} / {c['different']}" for name, c in results["same_text_as_plain"].items())
    lines += ["", f"Requests with the plain server's text, same / different: {same}."]
    return "\n".join(lines)
