"""The figures of docs/benchmarks.md's prose and goals, and of the README, each computed from its results file.

Each `Figure` is a sentence as the page writes it, with `{}` where each figure stands, and a function that computes
the figures from the results files of docs/benchmarks/ (formatted as the page writes them). `check_report.py` checks
that the sentence, with the computed figures in place, is in the page. Speeds are tokens per second over `plain`'s
(the bench's `speedup`) unless a helper says otherwise.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
REPORT = "docs/benchmarks.md"
README = "README.md"


@dataclass(frozen=True)
class Figure:
    """A sentence of a page with figures in it: `{}` where each figure stands, and how they are computed."""

    page: str
    sentence: str
    compute: Callable[[], tuple[str, ...]]

    def expected(self) -> str:
        return self.sentence.format(*self.compute())


@cache
def load(name: str) -> dict[str, Any]:
    """A results file of docs/benchmarks/ by its name relative to that folder."""
    return json.loads((RESULTS / name).read_text())


def run(name: str, method: str, batch: int | None = None) -> dict[str, Any]:
    runs = [r for r in load(name)["runs"] if r["method"] == method and batch in (None, r["batch_size"])]
    if len(runs) != 1:
        raise LookupError(f"{name}: {len(runs)} runs of {method} at batch {batch}")
    return runs[0]


def speed(name: str, method: str, over: str = "plain", batch: int | None = None) -> float:
    """`method`'s tokens per second over `over`'s in one results file."""
    return run(name, method, batch)["tokens_per_s"] / run(name, over, batch)["tokens_per_s"]


def per_repetition(name: str, method: str, over: str = "plain", batch: int | None = None) -> list[float]:
    """`method`'s speed over `over`'s in each repetition (wall time of `over` over `method`'s)."""
    ours, theirs = run(name, method, batch)["wall_s_repetitions"], run(name, over, batch)["wall_s_repetitions"]
    return [t / o for o, t in zip(ours, theirs)]


def x(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}x"


def span(values: list[float], digits: int = 2) -> str:
    """`1.03x-1.10x`: lowest and highest."""
    return f"{min(values):.{digits}f}x-{max(values):.{digits}f}x"


def pct(value: float, digits: int = 0) -> str:
    return f"{100 * value:.{digits}f}%"


# Results files of the sections, by what they hold.
HE_B1_128, SG_B1_128 = "tf524_humaneval_b1_128.json", "tf524_sharegpt_b1_128.json"
HE_B1_48, SG_B1_48 = "bf16_humaneval_b1_48_34bd3df.json", "bf16_sharegpt_b1_48_8b2eca2.json"
HE_B16, SG_B16 = "bf16_humaneval_b16_32_34bd3df.json", "bf16_sharegpt_b16_32_34bd3df.json"
HE_B16_STATIC, SG_B16_STATIC = "bf16_humaneval_b16_32.json", "bf16_sharegpt_b16_32.json"
HE_B16_FOLDED, SG_B16_FOLDED = "amx_bf16_humaneval_b16_32_folded.json", "amx_bf16_sharegpt_b16_32_folded.json"
LONG_TAIL = "bf16_long_tail.json"
CODEEDIT, CODEEDIT_256 = "bf16_codeedit_b1.json", "bf16_codeedit_b1_256.json"
LOOKAHEAD = "bf16_humaneval_b1_lookahead.json"
AGENT_SUFFIX, CODEEDIT_SUFFIX = "bf16_agent_b1_suffix_amx.json", "bf16_codeedit_b1_suffix_amx.json"
AGENT_HYBRID = "bf16_agent_b1_48_hybrid_amx.json"
SUFFIX_HINDSIGHT_CODEEDIT = "suffix_headroom_codeedit_amx_96.json"
ENVELOPE = {s: f"default_envelope/{s}_b1_48.json" for s in ("tools", "agent", "codeedit", "humaneval", "sharegpt")}
FOLLOWUPS_AMX = "default_envelope/followups_b1_48_amx.json"
ENVELOPE_HE_B16, ENVELOPE_SG_B16 = "default_envelope/humaneval_b1_b16_48.json", "default_envelope/sharegpt_b16_48.json"
SERVE_TOOLS = "default_envelope/serve_tools_light_48.json"
HELD_OUT = {s: f"default_choice/{s}_heldout_b1_{n}_amx.json" for s, n in (("followups", 96), ("sharegpt", 48))}
HELD_OUT_B16 = "default_choice/humaneval_heldout_b16_48_amx.json"
TREE_HE, TREE_SG, TREE_B16 = "tree_humaneval_b1_128.json", "tree_judge_sharegpt_b1.json", "tree_humaneval_b16.json"
OFFLOAD_AMX = ("offload_b1_1df3d22.json", "offload_b1_1df3d22_rerun.json", "offload_b1_a92c57e.json")
OFFLOAD_AMX_HELDOUT, OFFLOAD_AMD = "offload_b1_heldout_a92c57e.json", "offload_b1_af38490.json"
OFFLOAD_AMD_HUMANEVAL = {  # every AMD EPYC run of the scenario's HumanEval prompts at 48 tokens with the preset's tree
    "offload_b1_398d3a3.json": "dynspec-tree:32:40", "offload_b1_3f29fd3.json": "dynspec-tree:32:40",
    "offload_b1_414687b.json": "dynspec-tree:32:40", "offload_b1_8b2eca2.json": "dynspec-tree:32:40",
    "offload_b1_8f401ac.json": "dynspec-tree:32:40", "offload_b1_af38490.json": "dynspec-tree:32:40",
    "offload_b1_node_floor.json": "dynspec-tree:32:40", "offload_b1_deep48.json": "dynspec-tree@deep:32:40",
}
OFFLOAD_SG, OFFLOAD_CODEEDIT = "offload_b1_sharegpt_node_floor.json", "offload_b1_codeedit.json"
PRESET_TREE, HF_ROWMAJOR = "dynspec-tree:32:40", "hf-assisted+rowmajor"
CHEAP_HE, CHEAP_SG = "cheap_draft_bf16_humaneval_b1.json", "cheap_draft_bf16_sharegpt_b1.json"
CHEAP_FP32, CHEAP_FP32_AMX = "cheap_draft_fp32_b1.json", "cheap_draft_fp32_b1_amx.json"
VOCABULARY = ("bf16_humaneval_b1_vocab.json", "bf16_sharegpt_b1_vocab.json")
XEON_FP32, AVX2_B1, AVX2_B16 = "avx512_fp32_humaneval_4581287.json", "avx2_humaneval_b1.json", "avx2_humaneval_b16.json"
AVX2_PROFILES = {"off": "avx2_fp32_narrow_off.json", "auto": "avx2_fp32_narrow_auto.json"}
ROLLOUT_512, ROLLOUT_256 = "rollout_512_bf16_amx_measured.json", "rollout_256_bf16_amx_measured.json"
ROLLOUT_4BIT, ROLLOUT_HINDSIGHT = "rollout_512_bf16_4bit.json", "rollout_headroom_512_amx.json"
EPOCHS = {tokens: f"epochs_{tokens}_bf16_epyc_context.json" for tokens in (128, 256, 512)}
SERVE_LIGHT, SERVE_SWEEP = "serve_mixed_32_bf16_4bit_light.json", "serve_mixed_32_bf16_4bit.json"
SERVE_AMX, SERVED_HTTP = "serve_mixed_32_bf16_4bit_light_amx.json", "served_4_bf16_epyc.json"
PROFILE_BF16, PROFILE_FP32, DRAFT_COSTS = "profile_bf16.json", "profile_fp32_b1.json", "draft_costs.json"
CONTEXT_KEYS, COUPLED_COST = "context_keys_128_amx.json", "coupled_cost_amx.json"
LOOP_OVERHEAD = "loop_overhead_amx.json"
PROXY, HEAD_HE = "overhead_proxy_amx.json", "head_humaneval_48_amx.json"


# ------------------------------------------------------------------------------------------------------ helpers


def best_static(name: str) -> float:
    return max(speed(name, r["method"]) for r in load(name)["runs"] if r["method"].startswith("dynspec-static"))


def envelope_best(name: str) -> float:
    return max(speed(name, m) for m in ("dynspec-draft", "dynspec-hybrid", "dynspec-suffix+draft"))


def envelope_spread(dataset: str) -> float:
    """How far apart the draft alone, the default, the hybrid and suffix+draft are at batch 1: fastest over slowest,
    minus 1."""
    speeds = [speed(ENVELOPE[dataset], m) for m in ("dynspec-draft", "dynspec-goodput", "dynspec-hybrid",
                                                     "dynspec-suffix+draft")]
    return max(speeds) / min(speeds) - 1


def offload(name: str, method: str = PRESET_TREE, over: str = HF_ROWMAJOR) -> float:
    return speed(name, method, over)


def profile_cost(name: str, batch: int, tokens: int) -> float:
    """The target forward's seconds at (batch, tokens per row) in a calibration profile."""
    entry = next(e for e in load(name)["target_forward"] if (e["batch_size"], e["tokens_per_row"]) == (batch, tokens))
    return entry["seconds"]


def draft_cost(model: str) -> float:
    return next(r["seconds"] for r in load(DRAFT_COSTS)["results"] if r["model"] == model)


def vocabulary_forward_ms(name: str, method: str) -> float:
    record = run(name, method)
    return 1000 * record["draft_seconds"] / record["draft_forwards"]


def serve_latency(name: str, method: str, rate_index: int = 0) -> float:
    """Median over the repetitions of the mean request latency at the file's `rate_index`-th rate."""
    rates = sorted({s["rate"] for s in load(name)["summary"]})
    return next(s["latency_s"] for s in load(name)["summary"] if s["method"] == method and s["rate"] == rates[rate_index])


def serve_per_repetition(name: str, method: str, over: str) -> list[float]:
    """`over`'s mean request latency over `method`'s in each repetition (the file's lowest rate)."""
    def mean_latency(m: str, repetition: int) -> float:
        record = next(r for r in load(name)["runs"] if r["method"] == m and r["repetition"] == repetition)
        return statistics.mean(q["latency_s"] for q in record["requests"])

    repetitions = sorted({r["repetition"] for r in load(name)["runs"]})
    return [mean_latency(over, k) / mean_latency(method, k) for k in repetitions]


def rollout_same_lengths(name: str, method: str) -> list[float]:
    return run(name, method)["vs_nospec_same_lengths"]


def epoch(tokens: int, updates: int) -> dict[str, Any]:
    return next(e for e in load(EPOCHS[tokens])["second_epoch"] if e["updates"] == updates)


def epoch_speed(tokens: int, updates: int, method: str) -> float:
    """A second-epoch method's speed over the coupled loop without speculation (as `epochs_table` prints it)."""
    runs = epoch(tokens, updates)["results"]["runs"]
    base = next(r for r in runs if r["method"] == "dynspec-nospec@coupled")
    record = next(r for r in runs if r["method"] == method)
    if record["rows"] == base["rows"]:
        return base["wall_s"] / record["wall_s"]
    return statistics.median(a / b for a, b in zip(record["vs_nospec_same_lengths"], base["vs_nospec_same_lengths"]))


def own_bound(tokens: int, updates: int, method: str) -> float:
    return epoch(tokens, updates)["realized"][method]["bound"]["speedup_over_nospec"]


def loop_bound(tokens: int, updates: int) -> float:
    return epoch(tokens, updates)["bound"]["speedup_over_nospec"]


def first_epoch(method: str) -> tuple[str, ...]:
    """A method's first-epoch speed over the standard loop at the same lengths, at 128, 256 and 512 tokens."""
    values = []
    for tokens in EPOCHS:
        record = next(r for r in load(EPOCHS[tokens])["first_epoch"]["runs"] if r["method"] == method)
        values.append(statistics.median(record["vs_nospec_same_lengths"]))
    return tuple(x(v) for v in values)


def reused_share() -> tuple[float, float]:
    """Reused tokens over the row tokens of each reusing run, lowest and highest over the three lengths."""
    shares = []
    for tokens in EPOCHS:
        for record in load(EPOCHS[tokens])["second_epoch"]:
            for r in record["results"]["runs"]:
                if r["method"].startswith("dynspec-reuse"):
                    shares.append(r["reused_tokens"] / r["new_tokens"])
    return min(shares), max(shares)


def best_over_loop_bound() -> list[float]:
    return [max(epoch_speed(t, u, m) for m in ("dynspec-reuse:32", "dynspec-reuse:32+draft")) / loop_bound(t, u)
            for t in EPOCHS for u in (1, 4)]


def draft_over_own_bound(tokens_set: tuple[int, ...]) -> list[float]:
    method = "dynspec-reuse:32+draft"
    return [epoch_speed(t, u, method) / own_bound(t, u, method) for t in tokens_set for u in (1, 4)]


def loaded_runs_without_drafts() -> tuple[str, str]:
    runs = [r for r in load(SERVE_SWEEP)["runs"] if r["method"] == "cb-draft"]
    return str(sum(r["speculation"]["draft_tokens"] == 0 for r in runs)), str(len(runs))


def serve_ratio(method: str, rate_index: int, name: str = SERVE_SWEEP) -> float:
    return serve_latency(name, "cb-plain", rate_index) / serve_latency(name, method, rate_index)


def served_http(rate_index: int) -> float:
    rates = sorted({s["rate"] for s in load(SERVED_HTTP)["summary"]})
    latency = {s["method"]: s["latency_s"] for s in load(SERVED_HTTP)["summary"] if s["rate"] == rates[rate_index]}
    return latency["cb-plain"] / latency["cb-draft"]


def proxy(method: str) -> float:
    """`method`'s speed over plain `generate` on the launch-bound proxy."""
    return next(row["x_plain"] for row in load(PROXY)["rows"] if row["method"] == method)


def mismatches() -> int:
    """Mismatched rows over every bench results file that docs/benchmarks.md links."""
    page = (RESULTS.parent.parent / REPORT).read_text()
    names = set(re.findall(r"\]\(benchmarks/([^)#]+\.json)\)", page))
    runs = [r for name in names if isinstance(load(name).get("runs"), list) for r in load(name)["runs"]]
    return sum((r.get("equivalence") or {}).get("mismatch", 0) for r in runs if isinstance(r, dict))


def coupled_extra() -> float:
    """What coupled sampling adds to a step of 1 row verifying 4 draft tokens, as a share of the step."""
    record = next(r for r in load(COUPLED_COST)["results"] if (r["rows"], r["draft"]) == (1, 4))
    return record["extra"] / record["step"]


def loop_overhead() -> tuple[str, ...]:
    results = load(LOOP_OVERHEAD)["results"]
    return tuple(pct(r["loop_share"], 2) for r in results)


# ------------------------------------------------------------------------------------------------------- README

README_FIGURES = [
    Figure(README, "it decodes {}-{} faster than plain greedy `generate` at batch 1 ({} and {} transformers' assisted "
                   "generation on code and on chat), and keeps plain's speed at batch 16, where a fixed draft length "
                   "loses up to {}",
           lambda: (x(speed(SG_B1_128, "dynspec-goodput")), x(speed(HE_B1_128, "dynspec-goodput")),
                    x(speed(HE_B1_128, "dynspec-goodput", "hf-assisted")),
                    x(speed(SG_B1_128, "dynspec-goodput", "hf-assisted")),
                    pct(1 - speed(SG_B16_STATIC, "dynspec-static:4")))),
    Figure(README, "a draft forward took {} ms instead of {} ms on HumanEval and {} ms instead of {} ms on ShareGPT",
           lambda: tuple(f"{vocabulary_forward_ms(name, m):.1f}" for name in VOCABULARY
                         for m in ("dynspec-goodput", "dynspec-goodput@wholevocab"))),
    Figure(README, "the preset's tree is {}-{} transformers' assisted generation given the same output kernel on an "
                   "Intel Xeon with AMX (three runs) and {}-{} on an AMD EPYC (eight runs)",
           lambda: (*span([offload(n) for n in OFFLOAD_AMX], 3).split("-"),
                    *span([offload(n, m) for n, m in OFFLOAD_AMD_HUMANEVAL.items()], 3).split("-"))),
    Figure(README, "so verifying 5 tokens costs {} one token instead of {}",
           lambda: tuple(x(profile_cost(AVX2_PROFILES[k], 1, 5) / profile_cost(AVX2_PROFILES[k], 1, 1))
                         for k in ("auto", "off"))),
]

# ------------------------------------------------------------------------------------------------------- report

MEASURES = [
    Figure(REPORT, "**Loop overhead** (work outside forwards): {} of a step at batch 1, {} at batch 8", loop_overhead),
]

GOALS = [
    Figure(REPORT, "| HumanEval {}, ShareGPT {} ([below](#batch-size-1-and-16)); `static:4` {} and {}; folded attention "
                   "(Intel Xeon with AMX): HumanEval {}, `static:4` {}; ShareGPT {}, `static:4` {} |",
           lambda: (x(speed(HE_B16, "dynspec-goodput")), x(speed(SG_B16, "dynspec-goodput")),
                    x(speed(HE_B16_STATIC, "dynspec-static:4")), x(speed(SG_B16_STATIC, "dynspec-static:4")),
                    x(speed(HE_B16_FOLDED, "dynspec-goodput")), x(speed(HE_B16_FOLDED, "dynspec-static:4")),
                    x(speed(SG_B16_FOLDED, "dynspec-goodput")), x(speed(SG_B16_FOLDED, "dynspec-static:4")))),
    Figure(REPORT, "| {} on HumanEval and {} on ShareGPT (48 tokens); {} and {} at 128 tokens |",
           lambda: tuple(x(speed(n, "dynspec-goodput") / best_static(n)) for n in (HE_B1_48, SG_B1_48, HE_B1_128,
                                                                                    SG_B1_128))),
    Figure(REPORT, "| at 128 tokens: HumanEval {}, ShareGPT {} `hf-assisted` |",
           lambda: tuple(x(speed(n, "dynspec-goodput", "hf-assisted")) for n in (HE_B1_128, SG_B1_128))),
    Figure(REPORT, "| HumanEval {} (128 tokens), ShareGPT {} ([below](#token-trees)) |",
           lambda: (x(speed(TREE_HE, "dynspec-tree@stopt3:16:8", "dynspec-goodput")),
                    x(speed(TREE_SG, "dynspec-tree@stopt3:16:8", "dynspec-goodput")))),
    Figure(REPORT, "| HumanEval {} (128 tokens); batch 16 {} |",
           lambda: (x(speed(TREE_HE, "dynspec-tree@stopt3:16:8", "hf-assisted")), x(speed(TREE_B16, "dynspec-tree")))),
    Figure(REPORT, "| {} plain against {} and {}; over the default `goodput` {} at 256 tokens",
           lambda: (x(speed(CODEEDIT, "dynspec-hybrid")), x(speed(CODEEDIT, "dynspec-prompt-lookup")),
                    x(speed(CODEEDIT, "dynspec-goodput@stepwise")),
                    x(speed(CODEEDIT_256, "dynspec-hybrid", "dynspec-goodput")))),
    Figure(REPORT, "48 tokens: `tools` {} the best ({} the draft alone), `agent` {} ({} the draft alone), code edits {} "
                   "({} the draft alone)",
           lambda: tuple(x(v) for s in ("tools", "agent", "codeedit")
                         for v in (speed(ENVELOPE[s], "dynspec-goodput") / envelope_best(ENVELOPE[s]),
                                   speed(ENVELOPE[s], "dynspec-goodput", "dynspec-draft")))),
    Figure(REPORT, "ShareGPT {} ({} the draft alone); HumanEval {} ({} the draft alone), batch 16 {} the draft alone; "
                   "ShareGPT batch 16 {}; serving `tools` at light load {} `cb-suffix+draft`, the best",
           lambda: tuple(x(v) for v in (
               speed(ENVELOPE["sharegpt"], "dynspec-goodput") / envelope_best(ENVELOPE["sharegpt"]),
               speed(ENVELOPE["sharegpt"], "dynspec-goodput", "dynspec-draft"),
               speed(ENVELOPE["humaneval"], "dynspec-goodput") / envelope_best(ENVELOPE["humaneval"]),
               speed(ENVELOPE["humaneval"], "dynspec-goodput", "dynspec-draft"),
               speed(ENVELOPE_HE_B16, "dynspec-goodput", "dynspec-draft", 16),
               speed(ENVELOPE_SG_B16, "dynspec-goodput", "dynspec-draft", 16),
               serve_latency(SERVE_TOOLS, "cb-suffix+draft") / serve_latency(SERVE_TOOLS, "cb-default")))),
    Figure(REPORT, "`agent`'s 1.3x out of reach here: the default is {} the draft alone, the best other {} |",
           lambda: (x(speed(ENVELOPE["agent"], "dynspec-goodput", "dynspec-draft")),
                    x(max(speed(ENVELOPE["agent"], m, "dynspec-draft")
                          for m in ("dynspec-hybrid", "dynspec-suffix+draft"))))),
    Figure(REPORT, "| long tail: ≥ 1.2x `plain` | {} ([history](benchmarks/history.md#long-tail-bfloat16)) |",
           lambda: (x(speed(LONG_TAIL, "dynspec-goodput")),)),
    Figure(REPORT, "with AVX2 only verifying 5 tokens costs {} one weight-first, not {}",
           lambda: tuple(x(profile_cost(AVX2_PROFILES[k], 1, 5) / profile_cost(AVX2_PROFILES[k], 1, 1))
                         for k in ("auto", "off"))),
    Figure(REPORT, "float32 with AVX2 only: {} at batch 1, {} at batch 16; Intel Xeon without AMX: {} and {}",
           lambda: (x(speed(AVX2_B1, "dynspec-goodput")), x(speed(AVX2_B16, "dynspec-goodput")),
                    x(speed(XEON_FP32, "dynspec-goodput", batch=1)), x(speed(XEON_FP32, "dynspec-goodput", batch=16)))),
    Figure(REPORT, "Intel Xeon with AMX: {} `hf-assisted+rowmajor` in three runs ({} `plain`), {} on held-out "
                   "problems; AMD EPYC: HumanEval {} in eight runs, ShareGPT {}, code edits {}",
           lambda: (span([offload(n) for n in OFFLOAD_AMX], 3), span([offload(n, over="plain") for n in OFFLOAD_AMX]),
                    x(offload(OFFLOAD_AMX_HELDOUT), 3),
                    span([offload(n, m) for n, m in OFFLOAD_AMD_HUMANEVAL.items()], 3),
                    x(offload(OFFLOAD_SG)), x(offload(OFFLOAD_CODEEDIT)))),
    Figure(REPORT, "AMD EPYC: 4-bit {} of a float32 target step |",
           lambda: (f"{draft_cost('qwen2.5-coder-0.5b@4bit') / profile_cost(PROFILE_FP32, 1, 1):.2f}",)),
    Figure(REPORT, "| {} (AMD EPYC), {} (AMX); with a bfloat16 target the 4-bit draft gives {} the bfloat16 draft's "
                   "speed |",
           lambda: (x(speed(CHEAP_FP32, "dynspec-goodput/4bit", "dynspec-goodput/fp32")),
                    x(speed(CHEAP_FP32_AMX, "dynspec-goodput/4bit", "dynspec-goodput/fp32"), 3),
                    x(speed(CHEAP_HE, "dynspec-goodput/4bit", "dynspec-goodput")))),
    Figure(REPORT, "at the same row lengths: 512 tokens {} per repetition, `static:2` {}; 256 tokens {}, `static:1` {} "
                   "([below](#rl-rollouts)); as sampled {} and {}",
           lambda: (span(rollout_same_lengths(ROLLOUT_512, "dynspec-goodput")),
                    span(rollout_same_lengths(ROLLOUT_512, "dynspec-static:2")),
                    span(rollout_same_lengths(ROLLOUT_256, "dynspec-goodput")),
                    span(rollout_same_lengths(ROLLOUT_256, "dynspec-static:1")),
                    x(speed(ROLLOUT_512, "dynspec-goodput", "dynspec-nospec")),
                    x(speed(ROLLOUT_256, "dynspec-goodput", "dynspec-nospec")))),
    Figure(REPORT, "at 512 {}-{}% below `static:2`",
           lambda: tuple(f"{100 * v:.0f}" for v in sorted(
               1 - a / b for a, b in zip(rollout_same_lengths(ROLLOUT_512, "dynspec-goodput"),
                                         rollout_same_lengths(ROLLOUT_512, "dynspec-static:2"))))[::2]),
    Figure(REPORT, "Intel Xeon with AMX: {} at the same lengths; AMD EPYC before folding, 4-bit draft: {}; suffix trees "
                   "with hindsight at most {}, {} tokens a forward in the tail, arctic-inference's replayed {}",
           lambda: (span(rollout_same_lengths(ROLLOUT_512, "dynspec-goodput")),
                    x(speed(ROLLOUT_4BIT, "dynspec-goodput/4bit", "dynspec-nospec")),
                    x(load(ROLLOUT_HINDSIGHT)["bound"]["first epoch"]["hindsight"]["speedup_over_nospec"]),
                    f"{load(ROLLOUT_HINDSIGHT)['bound']['first epoch']['hindsight']['tail_tokens_per_forward']:.2f}",
                    x(load(ROLLOUT_HINDSIGHT)["bound"]["first epoch"]["replayed"]["speedup_over_nospec"]))),
    Figure(REPORT, "second rollout: at most {} with hindsight, replayed {}; code edits {}, at most {} with hindsight; "
                   "follow-ups on an earlier answer (`agent`) {}, the hybrid {} as fast",
           lambda: (x(load(ROLLOUT_HINDSIGHT)["bound"]["second epoch"]["hindsight"]["speedup_over_nospec"]),
                    x(load(ROLLOUT_HINDSIGHT)["bound"]["second epoch"]["replayed"]["speedup_over_nospec"]),
                    x(speed(CODEEDIT_SUFFIX, "dynspec-suffix+draft", "dynspec-goodput")),
                    x(load(SUFFIX_HINDSIGHT_CODEEDIT)["oracle"]["draft"]["seconds"]
                      / load(SUFFIX_HINDSIGHT_CODEEDIT)["oracle"]["draft+suffix"]["seconds"]),
                    x(speed(AGENT_SUFFIX, "dynspec-suffix+draft", "dynspec-goodput")),
                    x(speed(AGENT_HYBRID, "dynspec-hybrid", "dynspec-suffix+draft")))),
    Figure(REPORT, "512 tokens, context keys, AMD EPYC: after 1 update `reuse:32` {}, `+draft` {} (bounds of their own "
                   "rows {}, {}: {} and {} of them); after 4: {} and {} (bounds {}, {}: {}, {})",
           lambda: tuple(x(v) for u in (1, 4) for v in (
               epoch_speed(512, u, "dynspec-reuse:32"), epoch_speed(512, u, "dynspec-reuse:32+draft"),
               own_bound(512, u, "dynspec-reuse:32"), own_bound(512, u, "dynspec-reuse:32+draft"),
               epoch_speed(512, u, "dynspec-reuse:32") / own_bound(512, u, "dynspec-reuse:32"),
               epoch_speed(512, u, "dynspec-reuse:32+draft") / own_bound(512, u, "dynspec-reuse:32+draft")))),
    Figure(REPORT, "0.9x of the bound met by `+draft` after 1 and 4 updates at 256 and 512 tokens ({}); at 128 {} and {} |",
           lambda: (span(draft_over_own_bound((256, 512))),
                    *(x(v, 3) for v in draft_over_own_bound((128,))))),
    Figure(REPORT, "{} more at 1 row x 4 tokens", lambda: (pct(coupled_extra(), 1),)),
    Figure(REPORT, "first epoch with context keys (AMD EPYC, 128-512 tokens) {} (loop), {} (default) |",
           lambda: (span([float(v[:-1]) for v in first_epoch("dynspec-nospec@coupled")]),
                    span([float(v[:-1]) for v in first_epoch("dynspec-goodput@coupled")]))),
    Figure(REPORT, "4-bit draft: {} at 0.125x capacity ({} per repetition, `static:3` {}); {}, {}, {} at 0.5x-2x",
           lambda: (x(serve_ratio("cb-draft", 0, SERVE_LIGHT)),
                    span(serve_per_repetition(SERVE_LIGHT, "cb-draft", "cb-plain")),
                    x(serve_ratio("cb-draft-static:3", 0, SERVE_LIGHT)),
                    *(x(serve_ratio("cb-draft", k)) for k in range(3)))),
    Figure(REPORT, "Intel Xeon with AMX, light load: {}, draft trees {}",
           lambda: (x(serve_ratio("cb-draft", 0, SERVE_AMX)), x(serve_ratio("cb-draft:4:8", 0, SERVE_AMX)))),
    Figure(REPORT, "| Intel Xeon with AMX: proxy {} with the default, {} at `static:8` ([below](#trained-draft-heads-intel-xeon-with-amx)); "
                   "HumanEval with the head trained here: the default {} `plain` at batch 1 ({} the draft alone), {} "
                   "at batch 16 |",
           lambda: (x(proxy("head-default")), x(proxy("head-static:8")), x(speed(HEAD_HE, "dynspec-head", batch=1)),
                    x(speed(HEAD_HE, "dynspec-head", "dynspec-draft", batch=1)),
                    x(speed(HEAD_HE, "dynspec-head", batch=16)))),
    Figure(REPORT, "| 0 `mismatch` in every run | {} | met |", lambda: (str(mismatches()),)),
]


SECTIONS = [
    Figure(REPORT, "at batch 1 verifying 9 tokens costs {} one token, nearly free, while at batch 16 the CPU is "
                   "compute-bound and 9 tokens per row cost {}",
           lambda: (x(profile_cost(PROFILE_BF16, 1, 9) / profile_cost(PROFILE_BF16, 1, 1)),
                    x(profile_cost(PROFILE_BF16, 16, 9) / profile_cost(PROFILE_BF16, 16, 1)))),
    Figure(REPORT, "At batch 1 `goodput` gives {}-{} plain, {} (HumanEval) and {} (ShareGPT) transformers' assisted "
                   "generation, and {} and {} the best fixed length",
           lambda: (x(speed(SG_B1_128, "dynspec-goodput")), x(speed(HE_B1_128, "dynspec-goodput")),
                    x(speed(HE_B1_128, "dynspec-goodput", "hf-assisted")),
                    x(speed(SG_B1_128, "dynspec-goodput", "hf-assisted")),
                    x(speed(HE_B1_128, "dynspec-goodput") / best_static(HE_B1_128)),
                    x(speed(SG_B1_128, "dynspec-goodput") / best_static(SG_B1_128)))),
    Figure(REPORT, "the newest policy is {} on both at 48 tokens",
           lambda: tuple(sorted({x(speed(n, "dynspec-goodput") / best_static(n)) for n in (HE_B1_48, SG_B1_48)}))),
    Figure(REPORT, "At batch 16 it stopped drafting and matched plain ({}: a test run shared the machine), where "
                   "`static:4` lost {} and {}",
           lambda: (x(min(run(HE_B16, "dynspec-goodput")["speedup_repetitions"])),
                    pct(1 - speed(HE_B16_STATIC, "dynspec-static:4")),
                    pct(1 - speed(SG_B16_STATIC, "dynspec-static:4")))),
    Figure(REPORT, "HumanEval `goodput` {} plain ({} per repetition), `static:4` {}",
           lambda: (x(speed(HE_B16_FOLDED, "dynspec-goodput")), span(run(HE_B16_FOLDED, "dynspec-goodput")[
               "speedup_repetitions"]), x(speed(HE_B16_FOLDED, "dynspec-static:4")))),
    Figure(REPORT, "ShareGPT, where less is accepted, `goodput` does not draft, {}, `static:4` {}",
           lambda: (x(speed(SG_B16_FOLDED, "dynspec-goodput")), x(speed(SG_B16_FOLDED, "dynspec-static:4")))),
    Figure(REPORT, "at 256 new tokens `goodput` (then the draft alone) is {} plain and the hybrid {}",
           lambda: (x(speed(CODEEDIT_256, "dynspec-goodput")), x(speed(CODEEDIT_256, "dynspec-hybrid")))),
    Figure(REPORT, "Draft lookahead is {} drafting token by token on code edits and {} on HumanEval",
           lambda: tuple(x(speed(n, "dynspec-goodput", "dynspec-goodput@stepwise")) for n in (CODEEDIT, LOOKAHEAD))),
    Figure(REPORT, "Suffix trees beside the draft: {} the draft alone on code edits, {} on `agent`",
           lambda: tuple(x(speed(n, "dynspec-suffix+draft", "dynspec-goodput")) for n in (CODEEDIT_SUFFIX,
                                                                                          AGENT_SUFFIX))),
    Figure(REPORT, "pays the draft's catch-up on 500-token prompts ({} s of {} s), suffix+draft half of it; the two "
                   "end level ({} per repetition)",
           lambda: (f"{run(ENVELOPE['tools'], 'dynspec-goodput')['catchup_seconds']:.0f}",
                    f"{run(ENVELOPE['tools'], 'dynspec-goodput')['wall_s']:.0f}",
                    span(per_repetition(ENVELOPE["tools"], "dynspec-goodput", "dynspec-suffix+draft")))),
    Figure(REPORT, "the default is {} the draft alone with {} of its draft forwards; no proposer is 1.3x the draft "
                   "alone on this CPU (suffix+draft {})",
           lambda: (x(speed(ENVELOPE["agent"], "dynspec-goodput", "dynspec-draft")),
                    pct(run(ENVELOPE["agent"], "dynspec-goodput")["draft_forwards"]
                        / run(ENVELOPE["agent"], "dynspec-draft")["draft_forwards"]),
                    x(speed(ENVELOPE["agent"], "dynspec-suffix+draft", "dynspec-draft")))),
    Figure(REPORT, "adds {} copied tokens (per repetition the methods overlap: {})",
           lambda: (str(run(ENVELOPE["codeedit"], "dynspec-goodput")["copied_tokens"]),
                    span([v for r in load(ENVELOPE["codeedit"])["runs"] if r["method"] != "plain"
                          for v in r["speedup_repetitions"]]))),
    Figure(REPORT, "built from Python's own sources) the default is the best, {} the draft alone",
           lambda: (x(speed(FOLLOWUPS_AMX, "dynspec-goodput", "dynspec-draft")),)),
    Figure(REPORT, "Held out, the default is {} the draft alone on follow-ups and {} on ShareGPT; at batch 16 on "
                   "held-out HumanEval {}",
           lambda: (*(x(speed(HELD_OUT[s], "dynspec-goodput", "dynspec-draft")) for s in ("followups", "sharegpt")),
                    x(speed(HELD_OUT_B16, "dynspec-goodput", "dynspec-draft", 16)))),
    Figure(REPORT, "held out (Intel Xeon with AMX): follow-ups {} the best, ShareGPT {}, batch 16 HumanEval {} the draft "
                   "alone",
           lambda: (*(x(speed(HELD_OUT[s], "dynspec-goodput") / envelope_best(HELD_OUT[s]))
                      for s in ("followups", "sharegpt")),
                    x(speed(HELD_OUT_B16, "dynspec-goodput", "dynspec-draft", 16)))),
    Figure(REPORT, "on ShareGPT and HumanEval, with few copies, all four are within {}",
           lambda: (pct(max(envelope_spread(k) for k in ("sharegpt", "humaneval"))),)),
    Figure(REPORT, "{} plain against {}, [ShareGPT](benchmarks/default_envelope/sharegpt_b16_48.json) {} against {})",
           lambda: tuple(x(speed(n, m, batch=16)) for n in (ENVELOPE_HE_B16, ENVELOPE_SG_B16)
                         for m in ("dynspec-goodput", "dynspec-draft"))),
    Figure(REPORT, "mean latency: `cb-default` {} s, `cb-suffix+draft` {} s, `cb-hybrid` {} s, `cb-draft` {} s, "
                   "`cb-plain` {} s: {} the best ({} per repetition)",
           lambda: (*(f"{serve_latency(SERVE_TOOLS, m):.2f}" for m in (
               "cb-default", "cb-suffix+draft", "cb-hybrid", "cb-draft", "cb-plain")),
               x(serve_latency(SERVE_TOOLS, "cb-suffix+draft") / serve_latency(SERVE_TOOLS, "cb-default")),
               span(serve_per_repetition(SERVE_TOOLS, "cb-default", "cb-suffix+draft")))),
    Figure(REPORT, "the two about cancel: {} the chain on HumanEval ({} `hf-assisted`), and on ShareGPT at 48 tokens {} "
                   "({} plain against {}",
           lambda: (x(speed(TREE_HE, "dynspec-tree@stopt3:16:8", "dynspec-goodput")),
                    x(speed(TREE_HE, "dynspec-tree@stopt3:16:8", "hf-assisted")),
                    x(speed(TREE_SG, "dynspec-tree@stopt3:16:8", "dynspec-goodput")),
                    x(speed(TREE_SG, "dynspec-tree@stopt3:16:8")), x(speed(TREE_SG, "dynspec-goodput")))),
    Figure(REPORT, "the policy turns trees off as it turns chains off ({} plain",
           lambda: (x(speed(TREE_B16, "dynspec-tree")),)),
    Figure(REPORT, "one run each: the tree ran at {} and {} plain, {} `hf-assisted+rowmajor` per repetition",
           lambda: (x(offload(OFFLOAD_AMX[2], over="plain")), x(offload(OFFLOAD_AMX_HELDOUT, over="plain")),
                    span([v for n in (OFFLOAD_AMX[2], OFFLOAD_AMX_HELDOUT)
                          for v in per_repetition(n, PRESET_TREE, HF_ROWMAJOR)], 3))),
    Figure(REPORT, "By the medians the preset's tree is {} `hf-assisted+rowmajor` on the Intel Xeon with AMX ({} held "
                   "out). On the AMD EPYC: {} on HumanEval ({} plain,",
           lambda: (x(offload(OFFLOAD_AMX[2]), 3), x(offload(OFFLOAD_AMX_HELDOUT), 3), x(offload(OFFLOAD_AMD), 3),
                    x(offload(OFFLOAD_AMD, over="plain")))),
    Figure(REPORT, "{}-{} over [eight runs](benchmarks/history.md#humaneval-once-more-offload)), {} on ShareGPT ({} plain,",
           lambda: (*span([offload(n, m) for n, m in OFFLOAD_AMD_HUMANEVAL.items()], 3).split("-"),
                    x(offload(OFFLOAD_SG)), x(offload(OFFLOAD_SG, over="plain")))),
    Figure(REPORT, "a 4-bit draft forward (bitsandbytes NF4) costs {} of a float32 target step and {} of a bfloat16 one, "
                   "against {} and {} for the float32 and bfloat16 drafts",
           lambda: tuple(f"{draft_cost(m) / profile_cost(p, 1, 1):.2f}" for m, p in (
               ("qwen2.5-coder-0.5b@4bit", PROFILE_FP32), ("qwen2.5-coder-0.5b@4bit", PROFILE_BF16),
               ("qwen2.5-coder-0.5b@fp32", PROFILE_FP32), ("qwen2.5-coder-0.5b@bf16", PROFILE_BF16)))),
    Figure(REPORT, "the 4-bit draft makes `goodput` {} faster than the bfloat16 draft ({} on ShareGPT",
           lambda: tuple(x(speed(n, "dynspec-goodput/4bit", "dynspec-goodput")) for n in (CHEAP_HE, CHEAP_SG))),
    Figure(REPORT, "transformers' assisted generation gains even more ({} plain against {})",
           lambda: (x(speed(CHEAP_HE, "hf-assisted/4bit")), x(speed(CHEAP_HE, "hf-assisted")))),
    Figure(REPORT, "With a float32 target it gives {} what the float32 draft gives on the Intel Xeon with AMX",
           lambda: (x(speed(CHEAP_FP32_AMX, "dynspec-goodput/4bit", "dynspec-goodput/fp32"), 3),)),
    Figure(REPORT, "and {} on the AMD EPYC, where the float32 draft never paid",
           lambda: (x(speed(CHEAP_FP32, "dynspec-goodput/4bit", "dynspec-goodput/fp32")),)),
    Figure(REPORT, "`static:2` accepted {} tokens per drafting row, the default {}: other rows",
           lambda: tuple(f"{run(ROLLOUT_512, m)['mean_accepted']:.2f}" for m in ("dynspec-static:2",
                                                                                  "dynspec-goodput"))),
    Figure(REPORT, "on its own rows {})", lambda: (span(rollout_same_lengths(ROLLOUT_512, "dynspec-nospec")),)),
    Figure(REPORT, "At 256 new tokens the default is the best method: {} `nospec` at the same lengths",
           lambda: (span(rollout_same_lengths(ROLLOUT_256, "dynspec-goodput")),)),
    Figure(REPORT, "with hindsight at most {} the loop without speculation on one sampled rollout, {} with the epoch "
                   "before cached",
           lambda: tuple(x(load(ROLLOUT_HINDSIGHT)["bound"][k]["hindsight"]["speedup_over_nospec"])
                         for k in ("first epoch", "second epoch"))),
    Figure(REPORT, "The cache gives {}-{}% of the second epoch's tokens",
           lambda: tuple(f"{100 * v:.0f}" for v in reused_share())),
    Figure(REPORT, "the best method runs at {} the bound (it ignores cost, the policy weighs it), `+draft` at {} the "
                   "bound of its own rows",
           lambda: (span(best_over_loop_bound()), span(draft_over_own_bound((128, 256, 512))))),
    Figure(REPORT, "after 4 updates {} of tokens reusable against {} by position",
           lambda: (pct(load(CONTEXT_KEYS)["results"]["context"]["reusable_share"]),
                    pct(load(CONTEXT_KEYS)["results"]["position"]["reusable_share"]))),
    Figure(REPORT, "First epoch without speculation, coupled over standard: {}, {}, {} (128, 256, 512)",
           lambda: first_epoch("dynspec-nospec@coupled")),
    Figure(REPORT, "`goodput` coupled over standard {}, {}, {}", lambda: first_epoch("dynspec-goodput@coupled")),
    Figure(REPORT, "Light load: {} per repetition (`static:3` {})",
           lambda: (span(serve_per_repetition(SERVE_LIGHT, "cb-draft", "cb-plain")),
                    span(serve_per_repetition(SERVE_LIGHT, "cb-draft-static:3", "cb-plain")))),
    Figure(REPORT, "cost as much as they save (`static:3` {}, then {})",
           lambda: (x(serve_ratio("cb-draft-static:3", 0)),
                    span([serve_ratio("cb-draft-static:3", k) for k in (1, 2)]))),
    Figure(REPORT, "the policy stops drafting (0 tokens in {} of {} loaded runs), so its {} is noise",
           lambda: (*loaded_runs_without_drafts(), span([serve_ratio("cb-draft", k) for k in range(3)]))),
    Figure(REPORT, "plain's capacity: mean latency {} and {} lower than plain `transformers serve`",
           lambda: (x(served_http(0)), x(served_http(1)))),
]

FIGURES: list[Figure] = README_FIGURES + MEASURES + GOALS + SECTIONS
"""Every figure of the pages' prose and goals, each with the sentence it stands in."""
