"""Run by `tests/test_tensor_parallel.py` under `torchrun --nproc_per_node 2` (not a test module itself).

Loads the saved tiny target tensor-parallel (`tp_plan="auto"`, gloo on CPU) and the draft unsharded, runs every case
on every rank and writes this rank's results to `<out_dir>/rank<r>.json` for the test to compare.

Usage: `torchrun --nproc_per_node 2 tests/tp_worker.py <target_dir> <draft_dir> <inputs.pt> <out_dir>`
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.distributed import DecisionBroadcast
from hf_dynspec.placement import Placement
from hf_dynspec.policies import GoodputPolicy, PolicyInput, StepFeedback
from hf_dynspec.policies.static import StaticPolicy

NEW_TOKENS = 16

VLLM_TABLE = {"num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 64, 2]]}

POLICY_CONFIGS = {
    "static": DynSpecConfig(num_speculative_tokens=4, policy="static"),
    "threshold": DynSpecConfig(num_speculative_tokens=4, policy="threshold", policy_options={"batch_size_threshold": 2}),
    "batch_table": DynSpecConfig(num_speculative_tokens=4, policy="batch_table", policy_options=VLLM_TABLE),
    "goodput": DynSpecConfig(num_speculative_tokens=4, policy="goodput"),
    "confidence": DynSpecConfig(num_speculative_tokens=4, policy="confidence", policy_options={"threshold": 0.5}),
    "heuristic": DynSpecConfig(num_speculative_tokens=4, policy="heuristic"),
    "goodput_tree": DynSpecConfig(num_speculative_tokens=3, policy="goodput", tree_node_budget=8, tree_branching=2),
    "goodput_tree_prefill": DynSpecConfig(
        num_speculative_tokens=3, policy="goodput", tree_node_budget=8, tree_branching=2, prefill_draft_confidence=0.3
    ),
    # the marginal stop decides from measured step costs, which differ per rank; it judges each tree whole
    "goodput_tree_judged": DynSpecConfig(
        num_speculative_tokens=4, policy="goodput", policy_options={"early_stop": "marginal"}, tree_node_budget=9,
        tree_branching=3, tree_stop_judges="tree", prefill_draft_confidence=0.3,
    ),
}


class RankSkewedGoodput(GoodputPolicy):
    """Goodput whose own decisions differ per rank, as unsynchronised wall-clock timings would make them.

    Each rank sees its draft times scaled by `100 ** rank`, and odd ranks flip the lengths they would choose
    (`max - k`) and never name rows for the model-free proposal (`free_rows` is `None`, as when nothing drafts), so
    the ranks disagree from the first step. `raw` records what this rank's policy asked for.
    """

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.raw: list[list[int]] = []

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        lengths = super().draft_lengths(request)
        if self.rank % 2:
            lengths = request.max_draft_tokens - lengths
        self.raw.append(lengths.tolist())
        return lengths

    def free_rows(self, request: PolicyInput) -> torch.BoolTensor | None:
        return None if self.rank % 2 else super().free_rows(request)

    def observe(self, feedback: StepFeedback) -> None:
        feedback.draft_seconds *= 100.0**self.rank
        super().observe(feedback)


class RankSkewedTreeStop(StaticPolicy):
    """Trees 3 deep that rank 0 stops after depth 1 and other ranks never stop, as a timing-based stop could decide:
    each rank grows a different tree, and only rank 0's may be verified. `shown` records the positions each rank judged."""

    def __init__(self, rank: int) -> None:
        super().__init__(3)
        self.rank = rank
        self.shown: list[int] = []

    def continue_drafting(self, row_ids, position, draft_probs):
        positions = torch.as_tensor(position).expand(row_ids.shape[0])
        self.shown.extend(positions.tolist())
        return torch.full_like(positions, self.rank > 0, dtype=torch.bool)


def speculative(target, draft, ids, mask, eos, **kwargs) -> list[list[int]]:
    out = target.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=eos,
        assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop,
        **kwargs,
    )
    return out.tolist()


def error_of(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return ""


def main(target_dir: str, draft_dir: str, inputs_path: str, out_dir: str) -> None:
    target = AutoModelForCausalLM.from_pretrained(
        target_dir, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float64
    )
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float64)
    rank = dist.get_rank()
    inputs = torch.load(inputs_path)
    eos = inputs["eos"]
    results: dict = {"rank": rank, "tp_size": target.tp_size, "greedy": {}}

    for name, config in POLICY_CONFIGS.items():
        for size in (1, 3):
            ids, mask = inputs[f"batch{size}"]
            results["greedy"][f"{name}-{size}"] = speculative(
                target, draft, ids, mask, eos, do_sample=False, dynspec_config=config
            )

    ids, mask = inputs["batch3"]
    torch.manual_seed(1000 + rank)  # every rank draws from its own random state
    results["sampling"] = speculative(
        target, draft, ids, mask, eos, do_sample=True, top_k=20, dynspec_config=POLICY_CONFIGS["static"]
    )

    torch.manual_seed(2000 + rank)  # sampled draft trees differ per rank; rank 0's tree is verified everywhere
    results["sampling_tree"] = speculative(
        target, draft, ids, mask, eos, do_sample=True, top_k=20, dynspec_config=POLICY_CONFIGS["goodput_tree"]
    )

    policy = RankSkewedGoodput(rank)
    results["skewed_goodput"] = speculative(
        target, draft, ids, mask, eos, do_sample=False, dynspec_config=POLICY_CONFIGS["goodput"],
        dynspec_policy=policy,
    )
    results["skewed_goodput_raw"] = policy.raw

    stop = RankSkewedTreeStop(rank)
    results["skewed_tree_stop"] = speculative(
        target, draft, ids, mask, eos, do_sample=False, dynspec_config=POLICY_CONFIGS["goodput_tree"],
        dynspec_policy=stop,
    )
    results["skewed_tree_stop_shown"] = stop.shown

    elsewhere = Placement(torch.device("cpu"), torch.device("cpu"), torch.device("meta"))  # a draft off this device
    results["error_misplaced_draft"] = error_of(lambda: DecisionBroadcast.for_run(target, draft, elsewhere))
    sharded = AutoModelForCausalLM.from_pretrained(
        draft_dir, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float64
    )
    results["error_sharded_draft"] = error_of(lambda: speculative(target, sharded, ids, mask, eos))

    # Data-parallel use of the same processes: an unsharded target per rank, each rank with its own batch. Nothing
    # may be broadcast here (the batches even differ in size).
    replica = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    own_ids, own_mask = inputs["batch1"] if rank == 0 else inputs["batch3"]
    results["replica"] = speculative(
        replica, draft, own_ids, own_mask, eos, do_sample=False, dynspec_config=POLICY_CONFIGS["goodput"]
    )

    replica._is_fsdp_managed_module = True  # how transformers recognises an FSDP2-sharded model
    results["error_fsdp_target"] = error_of(lambda: speculative(replica, draft, own_ids, own_mask, eos))

    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
