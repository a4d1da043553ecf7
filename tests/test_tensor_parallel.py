"""A tensor-parallel target under torchrun: every rank takes rank 0's decisions and output stays exact.

One `torchrun --nproc_per_node 2` launch (gloo on CPU) of `tests/tp_worker.py` runs every case; the tests compare
its two ranks with each other and with plain single-process `generate` of the same unsharded target.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil  # accelerate's dependency
import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model

from hf_dynspec.candidates.base import Proposal
from hf_dynspec.devices import tensor_parallel_group
from hf_dynspec.distributed import DecisionBroadcast
from hf_dynspec.placement import Placement
from hf_dynspec.verification import tree_outcome

WORKER = Path(__file__).with_name("tp_worker.py")
POLICIES = [
    "static", "threshold", "batch_table", "goodput", "confidence", "heuristic", "goodput_tree", "goodput_tree_prefill",
    "goodput_tree_judged",
]
NEW_TOKENS = 16  # as in the worker
LAUNCH_TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny float64 Qwen2 target (sizes divisible by 2 for sharding), a perturbed draft, both saved."""
    target = tiny_model("qwen2", seed=0)
    draft = perturbed(target, scale=0.1)
    folder = tmp_path_factory.mktemp("tp_models")
    target.save_pretrained(folder / "target")
    draft.save_pretrained(folder / "draft")
    return target, draft, folder


@pytest.fixture(scope="module")
def inputs(models):
    """Left-padded batches of 1 and 3 prompts and an EOS token the target emits, so rows finish at different steps."""
    target, _, folder = models
    batches = {1: left_padded_prompts([6], seed=3), 3: left_padded_prompts([4, 9, 6], seed=4)}
    ids, mask = batches[3]
    free = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS)
    eos = int(torch.bincount(free[:, ids.shape[1] + 2 :].reshape(-1)).argmax())
    saved = {"eos": eos, "batch1": batches[1], "batch3": batches[3]}
    torch.save(saved, folder / "inputs.pt")
    return saved


@pytest.fixture(scope="module")
def expected(models, inputs) -> dict[int, list[list[int]]]:
    """Plain greedy `generate` of the unsharded target in this single process."""
    target = models[0]
    outputs = {}
    for size in (1, 3):
        ids, mask = inputs[f"batch{size}"]
        out = target.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=inputs["eos"]
        )
        outputs[size] = out.tolist()
    return outputs


def kill_launch(launch: subprocess.Popen) -> None:
    """Kill torchrun and every process it started: its ranks run in sessions of their own, out of reach of its
    process group, and alive they would keep its output pipes open."""
    started = psutil.Process(launch.pid).children(recursive=True)
    os.killpg(launch.pid, signal.SIGKILL)
    for process in started:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def ranks(models, inputs) -> list[dict]:
    """Both ranks' results from one torchrun launch of the worker."""
    _, _, folder = models
    out_dir = folder / "results"
    out_dir.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(WORKER), str(folder / "target"), str(folder / "draft"),
        str(folder / "inputs.pt"), str(out_dir),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launch = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = launch.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_launch(launch)  # torchrun and both ranks (a hung collective never returns)
        stdout, stderr = launch.communicate(timeout=60)
        pytest.fail(f"torchrun did not finish in {LAUNCH_TIMEOUT} s (ranks disagreeing hang the collectives):\n"
                    f"{stderr[-6000:]}")
    assert launch.returncode == 0, f"torchrun failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_target_is_sharded_over_both_ranks(ranks) -> None:
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["tp_size"] == 2 for r in ranks)


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_single_process_generate_on_every_rank(ranks, expected, policy, size) -> None:
    for result in ranks:
        assert result["greedy"][f"{policy}-{size}"] == expected[size], (policy, size, result["rank"])


def test_rows_finish_at_different_steps(expected, inputs) -> None:
    """The EOS makes the batch shrink while decoding, so dropping rows is exercised under tensor parallelism."""
    generated = torch.tensor(expected[3])[:, inputs["batch3"][0].shape[1] :]
    lengths = {int((row != inputs["eos"]).cumprod(0).sum()) for row in generated}
    assert len(lengths) > 1


@pytest.mark.parametrize("case", ["sampling", "sampling_tree"])
def test_sampling_gives_identical_tokens_on_ranks_with_different_random_states(ranks, inputs, case) -> None:
    first, second = (r[case] for r in ranks)
    assert first == second
    ids = inputs["batch3"][0]
    assert torch.equal(torch.tensor(first)[:, : ids.shape[1]], ids)
    assert torch.tensor(first).shape[1] > ids.shape[1]


def test_rank_dependent_goodput_decisions_are_overruled_by_rank_zero(ranks, expected) -> None:
    raw = [r["skewed_goodput_raw"] for r in ranks]
    assert raw[0] != raw[1]  # left alone, the ranks would feed different widths to the sharded target
    assert ranks[0]["skewed_goodput"] == ranks[1]["skewed_goodput"] == expected[3]


def test_rank_dependent_tree_stops_are_overruled_by_rank_zero(ranks, expected) -> None:
    """Rank 0 stops its trees at depth 1 and rank 1 grows them 3 deep: rank 0's trees are verified on both."""
    shown = [r["skewed_tree_stop_shown"] for r in ranks]
    assert set(shown[0]) == {0} and {0, 1} <= set(shown[1])  # the ranks' own trees differ in depth
    assert ranks[0]["skewed_tree_stop"] == ranks[1]["skewed_tree_stop"] == expected[3]


def test_draft_must_be_a_full_copy_on_each_rank_device(ranks) -> None:
    for result in ranks:
        assert "draft.to(model.device)" in result["error_misplaced_draft"]
        assert "without `tp_plan`" in result["error_sharded_draft"]


def test_fsdp_target_is_refused_as_it_needs_synced_gpus(ranks) -> None:
    for result in ranks:
        assert "synced_gpus" in result["error_fsdp_target"]


def test_unsharded_targets_in_a_multi_process_run_decide_per_rank(ranks, expected) -> None:
    """Data-parallel use (each rank its own batch, of a different size) broadcasts nothing."""
    assert ranks[0]["replica"] == expected[1]
    assert ranks[1]["replica"] == expected[3]


def test_single_process_broadcast_is_a_no_op(models) -> None:
    target, draft, _ = models
    assert tensor_parallel_group(target) is None
    decisions = DecisionBroadcast.for_run(target, draft, Placement.of(torch.device("cpu"), target, draft))
    assert not decisions.enabled
    lengths = torch.tensor([3, 0, 2])
    proposal = Proposal(torch.tensor([[5, 6, 7], [0, 0, 0], [8, 9, 0]]), lengths, None)
    tree = proposal.tree(torch.tensor([1, 2, 3]))
    outcome = tree_outcome(tree, torch.tensor([1, 0, 2]), torch.tensor([4, 5, 6]))
    assert decisions.lengths(lengths) is lengths
    assert decisions.proposal(proposal) is proposal
    assert decisions.verdict(tree, outcome) is outcome
