"""The serve scenario: requests arriving at random times into transformers' continuous batching, with and without
speculation, at a sweep of request rates up to saturation.

Each rate has one arrival trace (Poisson: exponential gaps, a fixed seed), the same for every method. A method is
plain continuous batching (`cb-plain`, `model.init_continuous_batching`), or a speculating manager
(`hf_dynspec.init_continuous_batching`) with a proposer and a policy:

- `cb-default`: what `DynSpecConfig()` does with a draft model: per request and step a copy from its context (suffix
  trees with the `suffix` extra, else prompt lookup) or the draft model, as the goodput policy decides;
- `cb-draft`, `cb-suffix`, `cb-lookup:N`: the draft model alone (in its own paged cache), suffix trees or prompt
  lookup (up to N tokens), draft lengths from the goodput policy;
- `cb-draft-static:K`, `cb-suffix-static:K`, `cb-lookup-static:K`: the same proposers, every decoding request drafting
  up to K tokens;
- `cb-<proposer>[-static]:K:N`: token trees of up to N nodes, K deep (suffix trees, lookup tries, a draft model's
  chain with its runner-up tokens);
- `cb-suffix+draft[-static][:K]`, `cb-hybrid[-static][:K]`: per request and step, suffix trees (prompt lookup) or
  the draft model, as the policy decides.

Per request: latency (arrival to last token), time to first token, time per output token after the first. Per run:
output tokens per second from the first arrival to the last token. The default rates are shares of the plain
manager's capacity, measured first: every request at once, requests per second. SmartSpec (arXiv 2406.14066) plots
mean latency against the rate; `plot_serve` draws that figure and time per output token beside it.
"""

from __future__ import annotations

import copy
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList

from .equivalence import VERDICTS, MarginRecorder, classify
from .equivalence import summarize as summarize_verdicts

DEFAULT_RATE_SHARES = (0.25, 0.5, 1.0, 2.0)
"""Default request rates, as shares of the plain manager's capacity (requests per second with every request at
once): from a mostly idle server to twice what it can serve."""


PROPOSER_SETTING = {"draft": "draft", "hybrid": "hybrid", "suffix": "suffix", "suffix+draft": "suffix"}
"""`DynSpecConfig.proposer` of a serve method's proposer (the others: "auto")."""


@dataclass(frozen=True)
class ServeMethod:
    """A way to serve: plain continuous batching, or speculation from `proposer` sized by `policy`."""

    name: str
    proposer: str | None = None  # "default", "draft", "hybrid", "suffix", "lookup" or "suffix+draft"; None: plain
    policy: str = "goodput"
    tokens: int = 4  # most draft tokens a request proposes in a step (a tree's depth)
    tree_nodes: int = 0  # token trees of at most this many nodes; 0: chains

    @classmethod
    def parse(cls, name: str) -> ServeMethod:
        """`cb-plain`, or `cb-<proposer>[-static][:K[:N]]` with proposer `default` (what `DynSpecConfig()` does with
        a draft model), `draft` (the draft model alone), `hybrid` (prompt lookup or the draft), `suffix`, `lookup` or
        `suffix+draft` (`:K:N`: trees of N nodes)."""
        if name == "cb-plain":
            return cls(name)
        base, *numbers = name.split(":")
        parts = base.split("-")
        proposers = ("default", "draft", "hybrid", "suffix", "lookup", "suffix+draft")
        if parts[0] != "cb" or len(parts) not in (2, 3) or parts[1] not in proposers or (
            len(parts) == 3 and parts[2] != "static"
        ) or len(numbers) > 2:
            raise ValueError(
                f"Unknown serve method {name!r}: use cb-plain, or cb-default, cb-draft, cb-hybrid, cb-suffix, "
                "cb-lookup or cb-suffix+draft, "
                "each optionally with -static and :K (cb-suffix-static:4), or trees of N nodes as cb-draft:K:N."
            )
        if any(not number.isdigit() or int(number) < 1 for number in numbers):
            raise ValueError(f"Serve method {name!r}: the numbers after ':' must be positive integers.")
        policy = "static" if len(parts) == 3 else "goodput"
        values = [int(number) for number in numbers]
        return cls(name, parts[1], policy, values[0] if values else 4, values[1] if len(values) > 1 else 0)

    @property
    def needs_draft(self) -> bool:
        """Whether the method drafts with the draft model (all but `cb-plain`, `cb-suffix` and `cb-lookup`)."""
        return self.proposer not in (None, "suffix", "lookup")

    def manager(self, model: torch.nn.Module, generation_config: Any, cb_config: Any, draft: Any = None):
        """A started manager for this method (`draft`: the draft model of `needs_draft` methods)."""
        if self.proposer is None:
            manager = model.init_continuous_batching(
                generation_config=generation_config, continuous_batching_config=cb_config
            )
        else:
            from ..candidates.suffix import clear_suffix_caches
            from ..continuous import init_continuous_batching

            clear_suffix_caches(model)  # every run starts from an empty cache: the trace's prompts repeat across runs
            manager = init_continuous_batching(
                model, generation_config=generation_config, continuous_batching_config=cb_config,
                **self.speculation(draft),
            )
        manager.start()
        return manager

    def dynspec_config(self) -> dict[str, Any]:
        """The `DynSpecConfig` settings of a speculating method."""
        return {"num_speculative_tokens": self.tokens, "policy": self.policy,
                "proposer": PROPOSER_SETTING.get(self.proposer, "auto"),
                "tree_node_budget": self.tree_nodes}

    def speculation(self, draft: Any = None) -> dict[str, Any]:
        """What `hf_dynspec.generate`, `generate_batch` and `init_continuous_batching` take to speculate as this
        method does: `assistant_model`, `prompt_lookup_num_tokens` and `dynspec_config`."""
        from ..config import DynSpecConfig

        return {"assistant_model": draft if self.needs_draft else None,
                "prompt_lookup_num_tokens": self.tokens if self.proposer == "lookup" else None,
                "dynspec_config": DynSpecConfig(**self.dynspec_config())}


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which `count` requests arrive at `rate` per second (Poisson; `inf`: all at 0)."""
    if rate == float("inf"):
        return [0.0] * count
    generator = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += generator.expovariate(rate)
    return times


def run_trace(manager: Any, prompts: list[list[int]], arrivals: list[float], max_new_tokens: int) -> dict[str, Any]:
    """Send `prompts[i]` at `arrivals[i]` seconds; per request its tokens, latency, TTFT and TPOT, and the run's
    output tokens per second."""
    if len(prompts) != len(arrivals):
        raise ValueError(f"{len(prompts)} prompts and {len(arrivals)} arrival times: give one arrival per prompt.")
    start = time.perf_counter()
    for index, (prompt, arrival) in enumerate(zip(prompts, arrivals)):
        time.sleep(max(0.0, start + arrival - time.perf_counter()))
        manager.add_request(prompt, request_id=f"r{index}", max_new_tokens=max_new_tokens, record_timestamps=True)
    outputs = {}
    while len(outputs) < len(prompts):
        output = manager.get_result(timeout=600)
        if output is None:
            raise RuntimeError("The continuous-batching manager stopped answering before every request finished.")
        if output.is_finished():
            if output.error is not None:
                raise RuntimeError(f"Request {output.request_id} failed: {output.error}")
            outputs[output.request_id] = output
    requests = [_request_metrics(outputs[f"r{i}"]) for i in range(len(prompts))]
    end = max(output.timestamps[-1] for output in outputs.values() if output.timestamps)
    tokens = sum(len(r["tokens"]) for r in requests)
    return {"requests": requests, "tokens_per_s": tokens / (end - start)}


def _request_metrics(output: Any) -> dict[str, Any]:
    stamps, arrival = output.timestamps or [], output.created_time
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return {
        "tokens": list(output.generated_tokens),
        "latency_s": stamps[-1] - arrival if stamps else None,
        "ttft_s": stamps[0] - arrival if stamps else None,
        "tpot_s": tpot,
    }


def summarize(run: dict[str, Any]) -> dict[str, float]:
    """Mean latency, TTFT and TPOT of a run's requests, and its output tokens per second."""
    requests = run["requests"]

    def mean(key: str) -> float:
        values = [r[key] for r in requests if r[key] is not None]
        return statistics.fmean(values) if values else float("nan")

    return {"latency_s": mean("latency_s"), "ttft_s": mean("ttft_s"), "tpot_s": mean("tpot_s"),
            "tokens_per_s": run["tokens_per_s"]}


def run_serve_benchmark(
    model: torch.nn.Module,
    prompts: list[list[int]],
    methods: list[ServeMethod],
    *,
    max_new_tokens: int,
    rates: list[float | str] | None,
    repetitions: int,
    seed: int,
    cb_config: dict[str, Any],
    progress: bool = True,
    draft: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """Every method at every rate (requests/s, or `"<share>x"` of the plain manager's capacity), `repetitions` times
    (methods rotated), on one arrival trace per rate; greedy.

    Returns the rates, each run's per-request metrics and speculation counts, the medians over repetitions per
    (method, rate), and each method's requests against plain greedy `generate` (`equivalence`: identical, near tie,
    mismatch; see `classify_requests`).
    """
    from transformers import ContinuousBatchingConfig

    generation_config = copy.deepcopy(model.generation_config)
    generation_config.update(do_sample=False, max_new_tokens=max_new_tokens, temperature=None, top_p=None,
                             top_k=None)
    plain = ServeMethod.parse("cb-plain")

    def serve(method: ServeMethod, arrivals: list[float]) -> dict[str, Any]:
        manager = method.manager(model, generation_config, ContinuousBatchingConfig(**cb_config), draft)
        try:
            run = run_trace(manager, prompts[: len(arrivals)], arrivals, max_new_tokens)
        finally:
            manager.stop(block=True)
        stats = getattr(manager, "speculation", None)
        run["speculation"] = None if stats is None else {
            "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
            "drafting_steps": stats.drafting_steps, "decode_steps": stats.decode_steps,
        }
        return run

    for method in methods:  # warm-up: a short untimed run of each method
        serve(method, [0.0] * min(2, len(prompts)))
    burst = serve(plain, [0.0] * len(prompts))
    capacity = len(prompts) / max(r["latency_s"] for r in burst["requests"])
    rates = arrival_rates(rates, capacity)
    runs = []
    schedule = [(rep, rate, shift) for rep in range(repetitions) for shift, rate in enumerate(rates)]
    for rep, rate, shift in tqdm(schedule, desc="serve runs", disable=not progress):
        arrivals = arrival_times(len(prompts), rate, seed + rates.index(rate))
        order = methods[(rep + shift) % len(methods):] + methods[: (rep + shift) % len(methods)]
        for method in order:
            run = serve(method, arrivals)
            runs.append({"method": method.name, "rate": rate, "repetition": rep, **run})
    return {
        "capacity_requests_per_s": capacity,
        "rates": rates,
        "runs": runs,
        "summary": _summary(runs, methods, rates),
        "equivalence": classify_requests(model, prompts, runs, generation_config, progress),
    }


def arrival_rates(values: list[float | str] | None, capacity: float) -> list[float]:
    """Arrival rates in requests/s, lowest first: each of `values` itself, or `"<share>x"` times `capacity` (the
    plain method's requests per second in a burst); `DEFAULT_RATE_SHARES` of it when `values` is empty."""
    return sorted(_rate(value, capacity) for value in (values or [f"{s}x" for s in DEFAULT_RATE_SHARES]))


def _rate(value: float | str, capacity: float) -> float:
    """A rate in requests/s: `value` itself, or `"<share>x"` times `capacity`."""
    if isinstance(value, str):
        return float(value.removesuffix("x")) * capacity
    return float(value)


def _summary(runs: list[dict[str, Any]], methods: list[ServeMethod], rates: list[float]) -> list[dict[str, Any]]:
    """Per (method, rate): the median over repetitions of each run's means."""
    rows = []
    for rate in rates:
        for method in methods:
            mine = [summarize(r) for r in runs if r["method"] == method.name and r["rate"] == rate]
            if mine:
                rows.append({"method": method.name, "rate": rate,
                             **{key: statistics.median(m[key] for m in mine) for key in mine[0]}})
    return rows


def classify_requests(
    model: torch.nn.Module,
    prompts: list[list[int]],
    runs: list[dict[str, Any]],
    generation_config: Any,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """Per method: its requests over every run, `identical`, `near_tie` or `mismatch` against plain greedy `generate`
    of the same prompt alone (`evaluation.equivalence.classify`, with plain's margins recorded), and each divergent
    request (`rows`: its rate, repetition, prompt, first divergent position, plain's margin there and the rounding
    bound). In low precision the batch a request shares changes its logits in the last bits, so `cb-plain` itself may
    differ from `generate` at a near tie; any other difference is a mismatch."""
    reference, margins = [], []
    for prompt in tqdm(prompts, desc="plain greedy reference", disable=not progress):
        recorder = MarginRecorder()
        ids = torch.tensor([prompt], device=model.device)  # [1, prompt]
        with torch.no_grad():
            output = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation_config,
                                    logits_processor=LogitsProcessorList([recorder]))
        reference.append(output[0, len(prompt):].tolist())
        margins.extend(recorder.rows())
    methods: dict[str, dict[str, Any]] = {}
    for run in runs:
        tokens = [request["tokens"] for request in run["requests"]]
        verdicts = classify(tokens, reference[: len(tokens)], margins[: len(tokens)], model.dtype)
        summary = summarize_verdicts(verdicts, model.dtype)
        totals = methods.setdefault(run["method"], {**dict.fromkeys(VERDICTS, 0), "dtype": summary["dtype"], "rows": []})
        for name in VERDICTS:
            totals[name] += summary[name]
        place = {key: run[key] for key in ("rate", "repetition") if key in run}
        totals["rows"] += [{**place, **row} for row in summary["rows"]]
    return methods


def serve_table(results: dict[str, Any]) -> str:
    """Markdown: per rate and method, mean latency (and against cb-plain), TTFT, TPOT and output tokens/s."""
    rows = results["summary"]
    plain = {r["rate"]: r["latency_s"] for r in rows if r["method"] == "cb-plain"}
    lines = [
        f"Serving (plain capacity {results['capacity_requests_per_s']:.3f} requests/s; medians of the repetitions):",
        "",
        "| rate (req/s) | method | mean latency s | vs cb-plain | TTFT s | TPOT ms | tokens/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        base = plain.get(row["rate"])
        ratio = f"{base / row['latency_s']:.2f}x" if base else "–"
        lines.append(f"| {row['rate']:.3f} | {row['method']} | {row['latency_s']:.2f} | {ratio} | "
                     f"{row['ttft_s']:.2f} | {1000 * row['tpot_s']:.0f} | {row['tokens_per_s']:.2f} |")
    verdicts = ", ".join(f"{name} {c['identical']} / {c['near_tie']} / {c['mismatch']}"
                         for name, c in results["equivalence"].items())
    lines += ["", f"Requests against plain greedy `generate`, identical / near-tie / mismatch: {verdicts}."]
    return "\n".join(lines)


def plot_serve(results: dict[str, Any], path: Path) -> Path:
    """Mean request latency (left) and time per output token (right) against the request rate, one line per
    method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    methods = dict.fromkeys(r["method"] for r in results["summary"])
    for method in methods:
        rows = sorted((r for r in results["summary"] if r["method"] == method), key=lambda r: r["rate"])
        rates = [r["rate"] for r in rows]
        latency.plot(rates, [r["latency_s"] for r in rows], marker="o", label=method)
        tpot.plot(rates, [1000 * r["tpot_s"] for r in rows], marker="o", label=method)
    for axes, label in ((latency, "mean request latency (s)"), (tpot, "time per output token (ms)")):
        axes.set_xlabel("request rate (requests/s)")
        axes.set_ylabel(label)
        axes.axvline(results["capacity_requests_per_s"], color="grey", linestyle=":", linewidth=1)
    latency.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def cb_config_for(prompts: list[list[int]], max_new_tokens: int, page: int = 64) -> dict[str, Any]:
    """`ContinuousBatchingConfig` settings with a paged cache for every request at once (pages of `page` tokens)."""
    longest = max(len(prompt) for prompt in prompts) + max_new_tokens
    return {"page_size": page, "num_blocks": len(prompts) * (math.ceil(longest / page) + 1),
            "max_batch_tokens": 1024, "use_async_batching": False}


def run_serve(settings: Any, progress: bool = True) -> dict[str, Any]:
    """The serve scenario for bench settings (`hf_dynspec.evaluation.settings.BenchSettings`): the target alone, its
    prompts, a paged cache sized for every request at once, and the run's configuration and machine."""
    from dataclasses import asdict

    from .bench import load_inputs, machine_description

    methods = [ServeMethod.parse(name) for name in settings.methods.split(",") if name]
    if not any(method.name == "cb-plain" for method in methods):
        methods.insert(0, ServeMethod.parse("cb-plain"))
    model, draft, prompts = load_inputs(settings, need_draft=any(method.needs_draft for method in methods))
    cb_config = cb_config_for(prompts, settings.max_new_tokens)
    results = run_serve_benchmark(
        model, prompts, methods, max_new_tokens=settings.max_new_tokens, rates=settings.rates,
        repetitions=settings.repetitions, seed=settings.seed, cb_config=cb_config, progress=progress, draft=draft,
    )
    config = {key: value for key, value in asdict(settings).items() if key != "loaded_models"}
    return {"config": {**config, "continuous_batching": cb_config, "prompt_tokens": [len(p) for p in prompts]},
            "machine": machine_description(), "models": settings.loaded_models, **results}

