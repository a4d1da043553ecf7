"""Run by `tests/test_clients.py` (not a test module itself): trains TRL's `GRPOTrainer` for 2 steps on tiny models with
a draft bound by `hf_dynspec.enable`, and writes what the speculative loop did to `<out_dir>/rank<r>.json`.

Usage: `python tests/grpo_worker.py <out_dir> full|lora|cb|reuse|reuse-lora ...` (one training run per word: a full
and a LoRA target with a bound draft, rollouts through transformers' continuous batching with suffix speculation, and
two epochs of a full and a LoRA target with coupled sampling and the rollout cache, no draft), alone or under
`accelerate launch --multi_gpu --num_processes 2` on the CPU (gloo); records go to `<out_dir>/<word>/rank<r>.json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import perturbed, tiny_model, word_tokenizer  # noqa: E402

import hf_dynspec  # noqa: E402
from hf_dynspec import DynSpecConfig  # noqa: E402
from hf_dynspec.continuous import SpeculativeManager  # noqa: E402
from hf_dynspec.loop import LoopRun  # noqa: E402

PROMPTS = ["w5 w9 w17", "w40 w3 w8", "w7 w7 w7", "w22 w23 w11"]


def length_reward(completions: list[str], **kwargs) -> list[float]:
    """Characters of the completion: samples of one prompt almost surely differ in it (words like `w5` and `w17`
    differ in length), so every group has an advantage to train on even when no sample ends early."""
    return [float(len(completion)) for completion in completions]


def train(out_dir: Path, lora: bool, continuous: bool = False, reuse: bool = False) -> None:
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    runs: list[dict] = []
    original, original_stop = LoopRun.generate, SpeculativeManager.stop

    def counted(self, model_kwargs):
        output = original(self, model_kwargs)
        runs.append({"rows": self.input_ids.shape[0], "draft_tokens": self.stats.draft_tokens,
                     "do_sample": self.do_sample, "policy": type(self.policy).__name__,
                     "coupled": self.coupled, "rollout_rows": self.stats.rollout_rows,
                     "reused_tokens": self.stats.reused_tokens, "emitted_tokens": self.stats.emitted_tokens})
        return output

    def counted_stop(self, *args, **kwargs):
        original_stop(self, *args, **kwargs)
        runs.append({"rows": self.speculation.requests,
                     "draft_tokens": self.speculation.draft_tokens, "do_sample": self.generation_config.do_sample,
                     "policy": type(self.speculator.policy).__name__})

    LoopRun.generate, SpeculativeManager.stop = counted, counted_stop
    out_dir.mkdir(parents=True, exist_ok=True)
    target = tiny_model("llama", seed=0, dtype=torch.float32)
    if reuse:
        config = DynSpecConfig(sampling="coupled", reuse_rollouts=True, policy="static")  # timings decide nothing
        hf_dynspec.enable(target, dynspec_config=config)
    elif continuous:
        config = DynSpecConfig(policy="static", num_speculative_tokens=3, proposer="suffix",
                               suffix_min_token_probability=0.0)
        hf_dynspec.enable(target, dynspec_config=config)
    else:
        draft = perturbed(target, scale=0.05, seed=rank).to(torch.float32)  # each rank its own draft
        hf_dynspec.enable(target, draft, dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=3))
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = GRPOConfig(
        output_dir=str(out_dir / "trainer"), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=-1 if reuse else 2, num_train_epochs=2, report_to="none", use_cpu=True, logging_steps=1, save_strategy="no", bf16=False,
        disable_tqdm=True, seed=0, use_transformers_continuous_batching=continuous,
        transformers_continuous_batching_config={"num_blocks": 64, "max_batch_tokens": 256} if continuous else None,
    )
    trainer = GRPOTrainer(
        model=target, reward_funcs=length_reward, args=args, processing_class=word_tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS if reuse else PROMPTS * 4}), peft_config=peft_config,
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    changed = any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters() if name in before)
    rank = trainer.accelerator.process_index
    record = {"rank": rank, "runs": runs, "trained": changed, "steps": trainer.state.global_step,
              "peft": type(trainer.model).__name__, "world_size": trainer.accelerator.num_processes, "backend": trainer.accelerator.state.backend}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    LoopRun.generate, SpeculativeManager.stop = original, original_stop


if __name__ == "__main__":
    for kind in sys.argv[2:]:
        train(Path(sys.argv[1]) / kind, lora=kind.endswith("lora"), continuous=kind == "cb", reuse=kind.startswith("reuse"))
