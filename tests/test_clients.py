"""Real clients run through the loop: TRL's GRPOTrainer (a bound draft, a LoRA target, two processes under
`accelerate launch`) and lm-evaluation-harness's `HFLM.generate_until` with its own stop-sequence criteria."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import BOS, EOS, PAD, VOCAB, perturbed, tiny_model, word_tokenizer

import hf_dynspec

WORKER = Path(__file__).with_name("grpo_worker.py")
LAUNCH_TIMEOUT = 600


def _run(command: list[str], out_dir: Path) -> dict[str, list[dict]]:
    """Each training run's records (`full`, `lora`), one per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return {kind.name: [json.loads(path.read_text()) for path in sorted(kind.glob("rank*.json"))]
            for kind in out_dir.iterdir() if kind.is_dir()}


def _check_rollouts(record: dict) -> None:
    """Two training steps whose completions the loop generated, sampling, with the bound draft drafting."""
    assert record["steps"] == 2 and record["trained"]
    assert len(record["runs"]) >= 2
    assert all(run["do_sample"] and run["rows"] >= 4 for run in record["runs"])
    assert sum(run["draft_tokens"] for run in record["runs"]) > 0


@pytest.mark.slow
def test_grpo_trains_with_a_bound_draft_and_with_a_lora_target(tmp_path):
    runs = _run([sys.executable, str(WORKER), str(tmp_path), "full", "lora"], tmp_path)
    for kind, model in (("full", "LlamaForCausalLM"), ("lora", "PeftModelForCausalLM")):
        (record,) = runs[kind]
        _check_rollouts(record)
        assert record["peft"] == model


def _check_reuse(record: dict) -> None:
    """Two epochs of coupled rollouts: the first finds nothing to reuse, the second reuses its own earlier samples."""
    runs = record["runs"]
    assert record["trained"] and all(run["coupled"] for run in runs)
    half = len(runs) // 2
    assert sum(run["rollout_rows"] for run in runs[:1]) == 0
    second = runs[half:]
    assert all(run["rollout_rows"] == run["rows"] for run in second), second
    assert sum(run["reused_tokens"] for run in second) > 0.5 * sum(run["emitted_tokens"] - run["rows"] for run in second)


@pytest.mark.slow
def test_grpo_epochs_reuse_their_rollouts(tmp_path):
    """TRL's GRPOTrainer, two epochs, a model enabled with coupled sampling and the rollout cache (no change to TRL):
    the second epoch's rollouts take most of their tokens from the first epoch's samples, full and LoRA targets."""
    runs = _run([sys.executable, str(WORKER), str(tmp_path), "reuse", "reuse-lora"], tmp_path)
    for kind in ("reuse", "reuse-lora"):
        (record,) = runs[kind]
        assert record["steps"] == 8
        _check_reuse(record)


@pytest.mark.slow
def test_grpo_rollouts_through_continuous_batching_speculate(tmp_path):
    """TRL's `use_transformers_continuous_batching` rollouts (`model.generate_batch`) of an enabled model speculate
    from suffix trees: the sibling samples of each prompt and the earlier steps' outputs."""
    (record,) = _run([sys.executable, str(WORKER), str(tmp_path), "cb"], tmp_path)["cb"]
    _check_rollouts(record)


@pytest.mark.slow
def test_grpo_under_accelerate_launch_on_two_processes(tmp_path):
    # `--multi_gpu` is accelerate's torch.distributed launcher; on a machine without GPUs (and `use_cpu=True`) the
    # processes join a gloo group (`--cpu` would launch a single process)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               str(WORKER), str(tmp_path), "full", "reuse"]
    runs = _run(command, tmp_path)
    records = runs["full"]
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["world_size"] == 2 and r["backend"] == "gloo" for r in records)
    for record in records:
        _check_rollouts(record)
    for record in runs["reuse"]:  # a group lands on either rank next epoch: the ranks share their samples
        _check_reuse(record)


# ---- lm-evaluation-harness ------------------------------------------------------------------------------------------
PROMPTS = ["w5 w9 w17", "w40 w3 w8 w8 w12 w61", "w7", "w22 w23 w11 w11", "w30 w31", "w9 w9 w9 w9 w9 w2 w6"]


def _requests(until: list[str], **gen_kwargs) -> list:
    from lm_eval.api.instance import Instance

    settings = {"until": until, "max_gen_toks": 24, "do_sample": False, **gen_kwargs}
    return [Instance(request_type="generate_until", doc={}, arguments=(prompt, dict(settings)), idx=i)
            for i, prompt in enumerate(PROMPTS)]


def _stop_words(target, tokenizer) -> list[str]:
    """Two words the target generates for some prompts and not for others, so that rows stop at different steps."""
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    out = target.generate(**encoded, do_sample=False, max_new_tokens=24)
    texts = [set(text.split()) for text in tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :],
                                                                   skip_special_tokens=True)]
    counts = {word: sum(word in words for words in texts) for words in texts for word in words}
    partial = sorted((w for w, c in counts.items() if 0 < c < len(PROMPTS)), key=lambda w: (-counts[w], w))
    return partial[:2]


@pytest.mark.parametrize("proposer", ["draft", "prompt_lookup"])
def test_lm_eval_generate_until_matches_the_harness_without_hf_dynspec(proposer):
    from lm_eval.models.huggingface import HFLM

    target = tiny_model("llama", seed=0, dtype=torch.float32)
    draft = perturbed(target, scale=0.05).to(torch.float32)
    tokenizer = word_tokenizer(specials={"pad": PAD, "bos": BOS, "eos": EOS, "unk": VOCAB - 1})  # lm-eval encodes "</s>"
    until = _stop_words(target, tokenizer)
    harness = HFLM(pretrained=target, tokenizer=tokenizer, batch_size=4)
    gen_kwargs = {"prompt_lookup_num_tokens": 3} if proposer == "prompt_lookup" else {}
    expected = harness.generate_until(_requests(until))
    assert any(len(text.split()) < 24 for text in expected)  # the stop sequences did stop rows
    calls = []
    original = hf_dynspec.integration.generate

    def counted(*args, **kwargs):
        calls.append(kwargs.get("assistant_model"))
        return original(*args, **kwargs)

    hf_dynspec.integration.generate = counted
    hf_dynspec.enable(target, draft if proposer == "draft" else None)
    try:
        assert harness.generate_until(_requests(until, **gen_kwargs)) == expected
    finally:
        hf_dynspec.disable(target)
        hf_dynspec.integration.generate = original
    assert len(calls) == 2  # two batches of at most 4 rows, both through the loop
    assert all((c is draft) == (proposer == "draft") for c in calls)
