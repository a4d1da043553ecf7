"""The rollout-epochs scenario: an RL epoch, GRPO updates of the policy, and the next epoch sampled again.

An RL trainer samples the same prompts every epoch with a policy that moved a little. With coupled sampling
(`hf_dynspec.coupling`) each sample of a prompt is a deterministic function of its stream and of the policy, so the
next epoch repeats the previous one wherever the policy barely moved, and the rollout cache proposes it back
(`candidates.rollout`). This scenario measures how much of that a real update leaves:

1. the first epoch: every prompt's `G` samples (the rollout scenario's prompts and settings), coupled, through the
   loop without speculation; the target's rollout cache keeps them (and, with `first_epoch_methods`, the loop with
   the standard sampler and with coupled sampling are timed on it: what coupled sampling costs with an empty cache);
2. `max(updates)` optimizer steps of TRL's `GRPOTrainer` on the same prompts with a LoRA adapter (peft's default
   modules for the model; a constant learning rate; the reward prefers shorter completions), whose own rollouts go
   through the loop with the rollout cache;
3. after each number of steps in `updates`: the KL divergence between the first epoch's policy and the current one
   on the first epoch's samples (per token), the second epoch timed with every method (the rollout cache set to the
   first epoch before each run), the agreement of the second epoch's samples with the first's, and a hindsight
   bound: the fewest verify forwards each row needs when the cache proposes exactly the tokens it gets right,
   priced as the loop without speculation's forwards of this run (and, with a calibration profile, each verify
   by its width). The bound is computed on the loop without speculation's rows (what the update changed) and on
   each reusing method's own rows: in low precision a verify forward over several tokens rounds otherwise than a
   one-token forward, so a perturbed argmax at a near tie may differ between them, and a row may leave its earlier
   sample where the policy did not move (`realized`).

Compare methods with the same rows: every coupled method writes the same tokens (`dynspec-nospec@coupled`'s); the
standard sampler's methods write other rows and compare at the same lengths (`vs_nospec_same_lengths`).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..candidates.rollout import RolloutSettings, rollout_cache_for
from ..config import DynSpecConfig
from ..coupling import REUSE_SEED, response_keys
from .bench import load_inputs, machine_description, run_benchmark, target_tokenizer
from .rollout import forward_seconds, matched_seconds
from .runner import left_pad, trim
from .settings import BenchSettings

COUPLED = "dynspec-nospec@coupled"
"""The loop without speculation, coupled: its rows are every coupled method's rows, and its forwards price them."""
FIRST_EPOCH_METHODS = "dynspec-nospec,dynspec-nospec@coupled,dynspec-goodput,dynspec-goodput@coupled"
SECOND_EPOCH_METHODS = "dynspec-nospec,dynspec-nospec@coupled,dynspec-goodput,dynspec-reuse:32,dynspec-reuse:32+draft"
METHOD_OPTIONS = {"nospec@coupled": {"sampling": "coupled", "seed": REUSE_SEED},
                  "goodput@coupled": {"sampling": "coupled", "seed": REUSE_SEED}}
"""Every coupled method samples with the seed the reusing methods use, so that all of them write the same rows."""
MAX_REUSED_TOKENS = 32
"""Most tokens a row may take from the rollout cache in one step (the methods' `dynspec-reuse:32`, the bound's cap)."""


@dataclass
class EpochSettings:
    """The updates between the epochs, and what is measured."""

    updates: list[int] = field(default_factory=lambda: [1, 4])
    """Optimizer steps after which the second epoch is measured (the first epoch's samples stay the cache's)."""
    learning_rate: float = 1e-5
    """Adam's learning rate, constant (TRL's default is 1e-6, meant for full fine-tuning; LoRA runs use more)."""
    lora_rank: int = 16
    first_epoch_methods: str = FIRST_EPOCH_METHODS
    """Methods timed on the first epoch (empty cache); '' skips that part."""
    methods: str = SECOND_EPOCH_METHODS
    """Methods timed on the second epoch."""
    profile: str | None = None
    """A calibration profile (`hf-dynspec calibrate`) that prices the bound's verifies by their width."""

    def __post_init__(self) -> None:
        if not self.updates or any(not isinstance(n, int) or n < 1 for n in self.updates):
            raise ValueError(f"`updates` must be positive step counts, got {self.updates}.")
        if not self.learning_rate > 0:
            raise ValueError(f"`learning_rate` must be positive, got {self.learning_rate}.")
        if self.profile is not None and not Path(self.profile).is_file():
            raise ValueError(f"No calibration profile at {self.profile!r}: create it with `hf-dynspec calibrate`.")
        self.updates = sorted(set(self.updates))


def run_epochs(settings: BenchSettings, epochs: EpochSettings, progress: bool = True) -> dict[str, Any]:
    """The scenario (see the module docstring); returns its results dict."""
    from peft import LoraConfig, get_peft_model

    if not settings.do_sample:
        raise ValueError("The rollout-epochs scenario samples (as an RL rollout does): pass --do-sample.")
    target, draft, prompts = load_inputs(settings)
    tokenizer = _tokenizer(settings)
    policy = get_peft_model(target, LoraConfig(r=epochs.lora_rank, lora_alpha=2 * epochs.lora_rank,
                                               task_type="CAUSAL_LM"))
    policy.eval()
    base = policy.get_base_model()  # the loop generates through it, the adapter's layers included
    settings = dataclasses.replace(settings, policy_options={**METHOD_OPTIONS, **settings.policy_options})
    first = sample_coupled(base, prompts, settings)
    rollouts = rollout_cache_for(base, RolloutSettings()).responses()
    results: dict[str, Any] = {
        "machine": machine_description(),
        "config": {"bench": dataclasses.asdict(settings), "epochs": dataclasses.asdict(epochs),
                   "prompts": prompts, "lora_modules": sorted(policy.peft_config["default"].target_modules)},
        "first_epoch_rows": first,
        "first_epoch": None,
        "second_epoch": [],
    }
    if epochs.first_epoch_methods:
        first_settings = dataclasses.replace(settings, methods=epochs.first_epoch_methods)
        results["first_epoch"] = run_benchmark(first_settings, base, draft, prompts, progress)

    keying = DynSpecConfig().coupling_keys  # the keys every method of the scenario samples with

    def measure(steps: int) -> None:
        second_settings = dataclasses.replace(settings, methods=epochs.methods)
        run = run_benchmark(second_settings, base, draft, prompts, progress, rollouts=rollouts, keep_rows=True)
        rows = {r["method"]: r["rows"] for r in run["runs"]}
        second = rows[COUPLED]
        reusing = [r["method"] for r in run["runs"] if r.get("reused_tokens") is not None]
        results["second_epoch"].append({
            "updates": steps,
            "kl_per_token": policy_kl(policy, prompts, first, settings),
            "agreement": agreement(first, second),
            "bound": hindsight_bound(first, second, run, epochs.profile, prompts, keying),
            "realized": {  # each reusing method's own rows (in low precision, its forwards round otherwise)
                name: {"agreement": agreement(first, rows[name]),
                       "bound": hindsight_bound(first, rows[name], run, epochs.profile, prompts, keying)}
                for name in reusing
            },
            "results": run,
        })

    train_grpo(policy, tokenizer, prompts, settings, epochs, measure, progress)
    return results


def _tokenizer(settings: BenchSettings):
    if settings.tiny:
        from .tiny import tiny_tokenizer

        return tiny_tokenizer()
    return target_tokenizer(settings)


def sample_coupled(model, prompts: list[list[int]], settings: BenchSettings) -> list[list[int]]:
    """Each row's coupled sample (new tokens up to its EOS) through the loop without speculation; the model's
    rollout cache keeps them."""
    config = model.generation_config
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    pad = int(config.pad_token_id if config.pad_token_id is not None else eos[0])
    ids, mask = left_pad(prompts, pad)
    import hf_dynspec

    rollout_cache_for(model, RolloutSettings()).clear()
    with torch.inference_mode():
        out = hf_dynspec.generate(
            model, input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=settings.max_new_tokens,
            pad_token_id=pad, **settings.sampling,
            dynspec_config=DynSpecConfig(sampling="coupled", reuse_rollouts=True, seed=REUSE_SEED,
                                         num_speculative_tokens=0),
        )
    return trim(out[:, ids.shape[1] :], set(eos))


# ---- the update ------------------------------------------------------------------------------------------------------
def shorter_is_better(completions: list[str], **kwargs: Any) -> list[float]:
    """The updates' reward: minus the completion's length in characters (GRPO normalises rewards per prompt)."""
    return [-float(len(completion)) for completion in completions]


def train_grpo(
    policy, tokenizer, prompts: list[list[int]], settings: BenchSettings, epochs: EpochSettings,
    measure: Callable[[int], None], progress: bool,
) -> None:
    """`max(updates)` optimizer steps of TRL's `GRPOTrainer` on the prompts (each step samples every prompt's `G`
    completions, with the rollout cache, and trains on them); `measure(steps)` after each step in `updates`, with
    the policy in eval mode and the loop's binding removed."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import hf_dynspec

    unique = list(dict.fromkeys(tuple(p) for p in prompts))
    bound = DynSpecConfig(sampling="coupled", reuse_rollouts=True, seed=REUSE_SEED)

    class AfterUpdates(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in epochs.updates:
                training = policy.training
                hf_dynspec.disable(policy)
                policy.eval()
                try:
                    measure(state.global_step)
                finally:
                    policy.train(training)
                    hf_dynspec.enable(policy, dynspec_config=bound)

    with tempfile.TemporaryDirectory() as scratch:
        args = GRPOConfig(
            output_dir=scratch, learning_rate=epochs.learning_rate, lr_scheduler_type="constant",
            num_generations=settings.samples_per_prompt, per_device_train_batch_size=settings.samples_per_prompt,
            gradient_accumulation_steps=len(unique), max_completion_length=settings.max_new_tokens,
            temperature=settings.temperature or 1.0, top_p=settings.top_p or 1.0, top_k=settings.top_k or 0,
            max_steps=max(epochs.updates), use_cpu=True, bf16=policy.dtype == torch.bfloat16, report_to="none",
            save_strategy="no", logging_steps=1, disable_tqdm=not progress, seed=settings.seed,
        )
        trainer = GRPOTrainer(
            model=policy, reward_funcs=shorter_is_better, args=args, processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": [tokenizer.decode(list(p)) for p in unique]}),
            callbacks=[AfterUpdates()],
        )
        hf_dynspec.enable(policy, dynspec_config=bound)
        try:
            trainer.train()
        finally:
            hf_dynspec.disable(policy)
    policy.eval()


# ---- what the update changed ---------------------------------------------------------------------------------------
@torch.inference_mode()
def policy_kl(policy, prompts: list[list[int]], rows: list[list[int]], settings: BenchSettings) -> float:
    """Mean over the first epoch's sampled tokens of KL(first policy || current policy) at the sampling temperature:
    the first policy is the model without its adapter (LoRA starts at zero)."""
    temperature = settings.temperature or 1.0
    total, count = 0.0, 0
    for prompt, row in tqdm(list(zip(prompts, rows)), desc="KL", leave=False):
        if not row:
            continue
        ids = torch.tensor([prompt + row])
        with policy.disable_adapter():
            before = policy(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # [new, vocab]
        after = policy(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        old, new = before.log_softmax(-1), after.log_softmax(-1)
        total += float((old.exp() * (old - new)).sum())
        count += len(row)
    return total / max(count, 1)


def agreement(first: list[list[int]], second: list[list[int]]) -> dict[str, Any]:
    """How much of the second epoch repeats the first: per-token agreement at the same positions, the shared prefix,
    and the rows that repeat exactly."""
    same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(first, second)]
    prefixes = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(first, second)]
    tokens = sum(map(len, second))
    return {
        "token_agreement": sum(same) / max(tokens, 1),
        "shared_prefix_share": sum(prefixes) / max(tokens, 1),
        "identical_rows": sum(x == y for x, y in zip(first, second)),
        "rows": len(second),
        "per_row_agreement": [s / max(len(y), 1) for s, y in zip(same, second)],
    }


def oracle_widths(
    earlier: Sequence[int],
    row: Sequence[int],
    max_tokens: int = MAX_REUSED_TOKENS,
    prompt: Sequence[int] = (),
    keying: str = "position",
) -> list[int]:
    """Tokens per row of each verify forward after the prefill when the rollout cache proposes, with hindsight, exactly
    the earlier sample's tokens that the row repeats from the one sampled with the row's next key on (`keying`, after
    `prompt`; by position, the row's own position), at most `max_tokens`, and the target adds one: the fewest
    forwards the row can take, each as narrow as it can be."""
    index = {key: n for n, key in enumerate(response_keys(prompt, earlier, keying))}
    keys = response_keys(prompt, row, keying)
    widths, n = [], 1  # the prefill wrote the first token
    while n < len(row):
        start, run = index.get(keys[n]), 0
        while (start is not None and run < max_tokens and n + run < len(row) - 1 and start + run < len(earlier)
               and earlier[start + run] == row[n + run]):
            run += 1
        widths.append(run + 1)
        n += run + 1
    return widths


def hindsight_bound(
    first: list[list[int]],
    second: list[list[int]],
    run: dict[str, Any],
    profile: str | None = None,
    prompts: list[list[int]] | None = None,
    keying: str = "position",
) -> dict[str, Any]:
    """The speed over the loop without speculation that the oracle schedules (`oracle_widths`, rows aligned by
    `keying` after their `prompts`) reach, in lockstep (a forward serves every row still writing), priced by active
    rows as that loop's forwards in `run`, with a calibration profile each verify by its width (its tokens against
    a one-token step, packed)."""
    calls = [c for t in run.get("timelines", []) if t["method"] == COUPLED for c in t["calls"]]
    start, by_rows = forward_seconds(calls)
    prompts = prompts or [[] for _ in second]
    widths = [oracle_widths(a, b, prompt=p, keying=keying) for a, b, p in zip(first, second, prompts)]
    width_cost = _width_cost(profile)
    seconds = start
    for step in range(max(map(len, widths), default=0)):
        active = [w[step] for w in widths if len(w) > step]
        one_token = float(np.interp(len(active), list(by_rows), list(by_rows.values())))
        seconds += one_token * width_cost(len(active), sum(active))
    nospec = matched_seconds([len(row) for row in second], start, by_rows)
    return {
        "speedup_over_nospec": nospec / seconds,
        "forwards": sum(map(len, widths)) + len(widths),
        "nospec_forwards": sum(map(len, second)),
        "verifies_priced": "by width (profile)" if profile else "as one-token forwards",
    }


def _width_cost(profile: str | None) -> Callable[[int, int], float]:
    """Cost of a verify forward over `tokens` target tokens at `rows` rows, relative to a one-token step at `rows`."""
    if profile is None:
        return lambda rows, tokens: 1.0
    from ..cost_models import Profile, ProfileCostModel

    verify = ProfileCostModel(Profile.load(profile)).verify
    return lambda rows, tokens: float(verify(np.array([float(tokens)]))[0] / verify(np.array([float(rows)]))[0])


def epochs_table(results: dict[str, Any]) -> str:
    """Markdown: per number of updates, the KL, the agreement, the bound, and every method's speed over the loop
    without speculation (coupled methods: same rows; the standard sampler: at the same lengths), with the seconds
    spent while 8+, 2-7 and 1 rows were active."""
    lines = _first_epoch_lines(results.get("first_epoch"))
    for epoch in results["second_epoch"]:
        share = epoch["agreement"]
        lines += [
            f"After {epoch['updates']} update(s): KL {epoch['kl_per_token']:.2e} per token, "
            f"{100 * share['token_agreement']:.0f}% of tokens as in the first epoch "
            f"({100 * share['shared_prefix_share']:.0f}% in shared prefixes, {share['identical_rows']}/{share['rows']} "
            f"rows identical); hindsight bound {epoch['bound']['speedup_over_nospec']:.2f}x "
            f"(verifies priced {epoch['bound']['verifies_priced']})"
            + "".join(f"; {name}'s own rows: {100 * r['agreement']['token_agreement']:.0f}% as in the first epoch, "
                      f"bound {r['bound']['speedup_over_nospec']:.2f}x" for name, r in epoch.get("realized", {}).items())
            + ".",
            "",
            "| method | wall s | vs nospec (coupled) | per repetition | reused tokens | 8+ rows s | 2-7 rows s | 1 row s |",
            "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
        ]
        runs = epoch["results"]["runs"]
        base = next(r for r in runs if r["method"] == COUPLED)
        for r in runs:
            speed = base["wall_s"] / r["wall_s"] if r["rows"] == base["rows"] else None
            matched = _relative_same_lengths(base, r)
            reps = (f"{min(matched):.2f} – {max(matched):.2f}x (same lengths)" if matched and speed is None
                    else " / ".join(f"{b / s:.2f}" for b, s in zip(base["wall_s_repetitions"], r["wall_s_repetitions"])))
            cells = [f"{speed:.2f}x" if speed else f"{statistics.median(matched):.2f}x*" if matched else "–", reps]
            buckets = " | ".join(f"{v:.1f}" for v in (r.get("active_seconds") or {}).values())
            lines.append(f"| {r['method']} | {r['wall_s']:.1f} | {' | '.join(cells)} | {r.get('reused_tokens') or 0} | "
                         f"{buckets} |")
        lines.append("")
    return "\n".join(lines)


def _speed(base: dict[str, Any], run: dict[str, Any]) -> float | None:
    """`run`'s speed over `base` (the coupled loop without speculation): on the same rows, else the median over the
    repetitions with both at their own lengths, else None."""
    if run["rows"] == base["rows"]:
        return base["wall_s"] / run["wall_s"]
    matched = _relative_same_lengths(base, run)
    return statistics.median(matched) if matched else None


def _relative_same_lengths(base: dict[str, Any], run: dict[str, Any]) -> list[float]:
    """Per repetition, `run`'s speed over `base` with both priced at their own row lengths: each one's speed over the
    standard loop without speculation at the same lengths, divided (the coupled loop samples faster than the standard
    one, so a ratio to the standard loop alone would credit coupling to the method)."""
    ours, theirs = run.get("vs_nospec_same_lengths") or [], base.get("vs_nospec_same_lengths") or []
    return [a / b for a, b in zip(ours, theirs)] if len(ours) == len(theirs) else []


def _first_epoch_lines(first: dict[str, Any] | None) -> list[str]:
    """The first epoch (empty cache): each method's speed over the loop without speculation with the standard sampler
    at the same lengths (median and range over the repetitions)."""
    if not first:
        return []
    lines = ["First epoch (empty rollout cache), speed over the loop without speculation at the same lengths:", "",
             "| method | wall s | vs nospec, same lengths | per repetition |", "| --- | ---: | ---: | --- |"]
    for r in first["runs"]:
        matched = r.get("vs_nospec_same_lengths") or [1.0]
        lines.append(f"| {r['method']} | {r['wall_s']:.1f} | {statistics.median(matched):.2f}x | "
                     f"{min(matched):.2f} – {max(matched):.2f}x |")
    return [*lines, ""]


def plot_epochs(results: dict[str, Any], path) -> str:
    """Speed over the loop without speculation against the KL divergence the updates made, for every method and the
    hindsight bound: on the coupled loop's own rows where a method wrote them, else at the same lengths (the median
    over the repetitions; in low precision a reusing method's rows may differ at near ties); writes a PNG and returns
    its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    epochs = results["second_epoch"]
    kl = [max(e["kl_per_token"], 1e-9) for e in epochs]
    figure, axis = plt.subplots(figsize=(6, 4))
    names = [r["method"] for r in epochs[0]["results"]["runs"]] if epochs else []
    for name in names:
        speeds = []
        for epoch in epochs:
            runs = {r["method"]: r for r in epoch["results"]["runs"]}
            speeds.append(_speed(runs[COUPLED], runs[name]))
        if all(v is not None for v in speeds) and name != COUPLED:
            axis.plot(kl, speeds, marker="o", label=name)
    axis.plot(kl, [e["bound"]["speedup_over_nospec"] for e in epochs], "k--", marker="x", label="hindsight bound")
    for x, epoch in zip(kl, epochs):
        axis.annotate(f"{epoch['updates']} update(s)", (x, 1.0), fontsize=8, rotation=90, va="bottom")
    axis.axhline(1.0, color="grey", linewidth=0.5)
    if max(kl) > 10 * min(kl):  # several orders of movement; a narrow range reads better on a linear axis
        axis.set_xscale("log")
    else:  # a narrow range: few ticks, in scientific notation, so their labels do not overlap
        axis.ticklabel_format(axis="x", style="sci", scilimits=(0, 0), useOffset=False)
        axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
    axis.set_xlabel("KL(first epoch's policy || updated policy) per token")
    axis.set_ylabel("speed over the loop without speculation")
    axis.set_title("Second epoch: rollout reuse against policy movement")
    axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return str(path)
