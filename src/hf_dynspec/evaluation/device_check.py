"""The device check: what a GPU lent for a few minutes must measure, on random-weight models built from the real
Qwen2.5 1.5B / 0.5B configs (no download), into one JSON file and a short text summary.

- `overhead`: the loop without speculation (`num_speculative_tokens=0`) against plain `generate`, at batch 1, 8, 32;
- `verify_curve`: the target's forward cost by new tokens per row and batch size, and the draft's (`calibrate`);
- `controlled_acceptance`: the default policy and a static one against plain `generate`, where the draft model runs
  for its cost but proposes the target's own greedy continuation, each token replaced by a wrong one with
  probability `1 - acceptance` (`OracleDraft`): the speed at a known acceptance;
- `syncs`: host synchronisations per decoding step, counted on the host (`evaluation.syncs`) and, on CUDA, as the
  device reports them (`torch.cuda.set_sync_debug_mode`).

`scripts/device_check.sh` runs the tests that need CUDA, then this module. With `--device cpu` it runs tiny configs in
seconds, so that it keeps working where no GPU is (a test runs it so).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from .. import loop
from ..calibration import CalibrationSettings, calibrate
from ..candidates import choice
from ..candidates.base import Proposal
from ..candidates.draft_model import DraftModelProposer
from ..candidates.tree import CHECK_ENV
from ..config import DynSpecConfig
from ..devices import upload
from ..sequences import TokenBatch
from .syncs import SyncCounter, counting_steps

QWEN25 = dict(
    vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, use_sliding_window=False, hidden_act="silu", bos_token_id=151643, eos_token_id=151643,
)
"""What the Qwen2.5 1.5B and 0.5B configs share (Hugging Face `config.json` of Qwen/Qwen2.5-1.5B and -0.5B)."""
QWEN25_1_5B = QWEN25 | dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                            num_key_value_heads=2)
QWEN25_0_5B = QWEN25 | dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                            num_key_value_heads=2)
TINY = dict(vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=1)
TINY_TARGET = TINY | dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2)
TINY_DRAFT = TINY | dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2)


def settings_for(device: str) -> dict[str, Any]:
    """What the check measures on `device`: the real configs and lengths on CUDA, tiny ones on the CPU."""
    if device == "cuda":
        return dict(target=QWEN25_1_5B, draft=QWEN25_0_5B, dtype=torch.bfloat16, prompt=128, new_tokens=128,
                    batches=[1, 8, 32], repeats=3, acceptance_batches=[1, 8], curve_batches=[1, 8, 32],
                    curve_tokens=[1, 2, 3, 5, 9, 17])
    return dict(target=TINY_TARGET, draft=TINY_DRAFT, dtype=torch.float32, prompt=8, new_tokens=8, batches=[1, 4],
                repeats=1, acceptance_batches=[1], curve_batches=[1, 2], curve_tokens=[1, 2])


def random_model(config: dict[str, Any], device: str, dtype: torch.dtype, seed: int) -> PreTrainedModel:
    """A Qwen2 model of `config` with random weights, built on `device` (no download)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    model = model.to(dtype).eval().requires_grad_(False)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random weights: every row runs to its length
    return model


def prompts(batch: int, length: int, vocab: int, device: str, seed: int = 0) -> torch.LongTensor:
    """`[batch, length]` random prompt ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=generator).to(device)


def finished(tensor: torch.Tensor) -> float:
    """`time.perf_counter()` once the device of `tensor` has done its queued work."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()


def timed(run: Callable[[], torch.Tensor], repeats: int) -> dict[str, Any]:
    """Median seconds of `repeats` runs after one untimed run, and the last run's output."""
    output = run()
    samples = []
    for _ in range(repeats):
        start = finished(output)
        output = run()
        samples.append(finished(output) - start)
    return {"seconds": statistics.median(samples), "samples": samples, "output": output}


def generate(target: PreTrainedModel, ids: torch.LongTensor, new_tokens: int, **kwargs) -> torch.Tensor:
    with torch.inference_mode():
        return target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               do_sample=False, **kwargs)


def speculative(config: DynSpecConfig, **kwargs) -> dict[str, Any]:
    return {"custom_generate": loop.speculative_loop, "dynspec_config": config, **kwargs}


NO_SPECULATION = DynSpecConfig(num_speculative_tokens=0, policy="static")
"""The loop without speculation (the bench's `dynspec-nospec`)."""


def overhead(target: PreTrainedModel, s: dict[str, Any], device: str) -> list[dict[str, Any]]:
    """Plain `generate` and the loop without speculation, per batch size: seconds and their ratio (plain / loop)."""
    rows = []
    for batch in s["batches"]:
        ids = prompts(batch, s["prompt"], target.config.vocab_size, device)
        plain = timed(partial(generate, target, ids, s["new_tokens"]), s["repeats"])
        nospec = speculative(NO_SPECULATION, prompt_lookup_num_tokens=1)  # a proposer never asked
        loop_run = timed(partial(generate, target, ids, s["new_tokens"], **nospec), s["repeats"])
        same = torch.equal(plain["output"], loop_run["output"])
        rows.append({"batch": batch, "plain_seconds": plain["seconds"], "loop_seconds": loop_run["seconds"],
                     "loop_speed_vs_plain": plain["seconds"] / loop_run["seconds"], "identical": same})
    return rows


class OracleDraft(DraftModelProposer):
    """The draft model proposer, drafting as always (its forwards cost what they cost), whose proposal is then
    replaced by the target's own greedy continuation (`oracle`, `[rows, new_tokens]` on the host), each token
    replaced with a wrong one with probability `1 - acceptance`: an acceptance rate chosen beforehand."""

    oracle: torch.LongTensor
    acceptance: float = 0.8
    generator: torch.Generator

    def propose(self, batch: TokenBatch, lengths: torch.LongTensor, *args, **kwargs) -> Proposal:
        proposal = super().propose(batch, lengths, *args, **kwargs)
        host_lengths = proposal.lengths_on_host()
        width = proposal.max_length
        rows, start = batch.host.row_ids, batch.host.num_generated  # [batch] each
        columns = (start.unsqueeze(1) + torch.arange(width)).clamp(max=self.oracle.shape[1] - 1)  # [batch, width]
        tokens = self.oracle[rows].gather(1, columns)
        wrong = torch.rand(tokens.shape, generator=self.generator) >= self.acceptance
        shift = torch.randint(1, self.draft_model.config.vocab_size, tokens.shape, generator=self.generator)
        tokens = torch.where(wrong, (tokens + shift) % self.draft_model.config.vocab_size, tokens)
        return Proposal(upload(tokens, proposal.tokens.device), proposal.lengths, None, host_lengths=host_lengths)


@contextlib.contextmanager
def oracle_drafts(oracle: torch.LongTensor, acceptance: float, seed: int = 0) -> Iterator[None]:
    """Inside, the loop's draft-model proposer is an `OracleDraft` of `oracle` at `acceptance`."""
    kind = type("OracleDraftRun", (OracleDraft,), {
        "oracle": oracle, "acceptance": acceptance, "generator": torch.Generator().manual_seed(seed),
    })
    saved = choice.DraftModelProposer
    choice.DraftModelProposer = kind
    try:
        yield
    finally:
        choice.DraftModelProposer = saved


def controlled_acceptance(
    target: PreTrainedModel, draft: PreTrainedModel, s: dict[str, Any], device: str, acceptance: float = 0.8
) -> list[dict[str, Any]]:
    """Plain `generate`, the default policy and `static` with 4 draft tokens, with `OracleDraft` at `acceptance`."""
    rows = []
    for batch in s["acceptance_batches"]:
        ids = prompts(batch, s["prompt"], target.config.vocab_size, device, seed=1)
        plain = timed(partial(generate, target, ids, s["new_tokens"]), s["repeats"])
        oracle = plain["output"][:, ids.shape[1] :].to("cpu", copy=True)
        row = {"batch": batch, "acceptance": acceptance, "plain_seconds": plain["seconds"]}
        for name, config in (("default", DynSpecConfig()), ("static:4", DynSpecConfig(policy="static"))):
            call = partial(generate, target, ids, s["new_tokens"], assistant_model=draft, **speculative(config))
            with oracle_drafts(oracle, acceptance):
                run = timed(call, s["repeats"])
            row[name] = {"seconds": run["seconds"], "speed_vs_plain": plain["seconds"] / run["seconds"],
                         "identical": torch.equal(run["output"], plain["output"])}
        rows.append(row)
    return rows


def verify_curve(target: PreTrainedModel, draft: PreTrainedModel, s: dict[str, Any]) -> dict[str, Any]:
    """`hf-dynspec calibrate`'s profile of the pair: target forward seconds by batch and new tokens per row."""
    settings = CalibrationSettings(batch_sizes=s["curve_batches"], tokens_per_row=s["curve_tokens"],
                                   context_length=s["prompt"], warmup=1, repeats=max(2, s["repeats"]))
    return calibrate(target, draft, settings, progress=False).to_dict()


def syncs(target: PreTrainedModel, draft: PreTrainedModel, s: dict[str, Any], device: str) -> list[dict[str, Any]]:
    """Synchronisations per decoding step of chains (greedy), counted on the host and, on CUDA, by the device."""
    rows = []
    for batch in s["acceptance_batches"]:
        ids = prompts(batch, s["prompt"], target.config.vocab_size, device, seed=2)
        for name, kwargs in (("draft", {"assistant_model": draft}), ("lookup", {"prompt_lookup_num_tokens": 4})):
            config = DynSpecConfig(policy="static", draft_lookahead=0)
            counter = SyncCounter()
            with unchecked_trees(), counting_steps(counter, [(loop.LoopRun, "step")]):
                generate(target, ids, 16, **speculative(config), **kwargs)
            row = {"batch": batch, "proposer": name, "host_count_per_step": max(counter.per_step(), default=0)}
            if device == "cuda":
                row["cuda_reported_per_step"] = max(cuda_reported(target, ids, config, kwargs), default=0)
            rows.append(row)
    return rows


@contextlib.contextmanager
def unchecked_trees() -> Iterator[None]:
    """Inside, the loop does not check its trees (`candidates.tree.CHECK_ENV`, set by the test suite): as it runs."""
    saved = os.environ.get(CHECK_ENV)
    os.environ[CHECK_ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[CHECK_ENV]
        else:
            os.environ[CHECK_ENV] = saved


def cuda_reported(target: PreTrainedModel, ids: torch.LongTensor, config: DynSpecConfig, kwargs: dict) -> list[int]:
    """Per decoding step, the synchronising calls CUDA reports (`torch.cuda.set_sync_debug_mode('warn')`)."""
    per_step: list[int] = []
    step = loop.LoopRun.step

    def counted(self, *args, **kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = step(self, *args, **kw)
        per_step.append(sum("synchroniz" in str(w.message) for w in caught))
        return out

    loop.LoopRun.step = counted
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with unchecked_trees():
            generate(target, ids, 16, **speculative(config), **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        loop.LoopRun.step = step
    return per_step


def run(device: str, out: Path) -> dict[str, Any]:
    """Every measurement on `device`; writes `device_check.json` and `device_check.txt` into `out`."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device_check: --device cuda, but torch sees no CUDA device (torch.cuda.is_available() is "
                         "False); run with --device cpu for the CPU check.")
    s = settings_for(device)
    began = time.perf_counter()
    target = random_model(s["target"], device, s["dtype"], seed=0)
    draft = random_model(s["draft"], device, s["dtype"], seed=1)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__, "dtype": str(s["dtype"]).replace("torch.", ""),
        "models": "random-weight Qwen2.5 1.5B / 0.5B configs" if device == "cuda" else "tiny random Qwen2 configs",
        "prompt_tokens": s["prompt"], "new_tokens": s["new_tokens"],
    }
    report["overhead"] = overhead(target, s, device)
    report["controlled_acceptance"] = controlled_acceptance(target, draft, s, device)
    report["syncs"] = syncs(target, draft, s, device)
    report["verify_curve"] = verify_curve(target, draft, s)
    report["seconds"] = time.perf_counter() - began
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "device_check.txt").write_text(summary(report))
    return report


def summary(report: dict[str, Any]) -> str:
    """A few lines: the device, the loop's overhead, the speed at controlled acceptance, the synchronisations."""
    lines = [f"device check on {report['device']} ({report['models']}, {report['dtype']}, torch {report['torch']}), "
             f"{report['prompt_tokens']}-token prompts, {report['new_tokens']} new tokens, {report['seconds']:.0f} s"]
    for row in report["overhead"]:
        lines.append(f"batch {row['batch']:>2}: loop without speculation {row['loop_speed_vs_plain']:.3f}x plain "
                     f"(plain {row['plain_seconds']:.3f} s, identical: {row['identical']})")
    for row in report["controlled_acceptance"]:
        speeds = ", ".join(f"{name} {row[name]['speed_vs_plain']:.2f}x (identical: {row[name]['identical']})"
                           for name in ("default", "static:4"))
        lines.append(f"batch {row['batch']:>2}, acceptance {row['acceptance']}: {speeds}")
    for row in report["syncs"]:
        cuda = f", CUDA reports {row['cuda_reported_per_step']}" if "cuda_reported_per_step" in row else ""
        lines.append(f"syncs per step, {row['proposer']} chain, batch {row['batch']}: counted "
                     f"{row['host_count_per_step']}{cuda}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_dynspec.evaluation.device_check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, default=Path("device_check_results"))
    args = parser.parse_args(argv)
    run(args.device, args.out)
    sys.stdout.write((args.out / "device_check.txt").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
