"""Coupled sampling in a data-parallel run of two processes: no twin samples, the same streams on either rank, and
rollouts shared across ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import left_padded_prompts, tiny_model

import hf_dynspec
from hf_dynspec import DynSpecConfig

NEW = 16


def _sample(model, ids, mask, reuse: bool):
    config = DynSpecConfig(sampling="coupled", seed=2, reuse_rollouts=reuse)
    return hf_dynspec.generate(model, input_ids=ids, attention_mask=mask, do_sample=True, top_k=None, top_p=None,
                               max_new_tokens=NEW, return_dict_in_generate=True, dynspec_config=config)


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, four samples of each: rows 0-3 and 4-7."""
    ids, mask = left_padded_prompts([5, 7], seed=6)
    return ids.repeat_interleave(4, dim=0), mask.repeat_interleave(4, dim=0)


def _worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=0, dtype=torch.float32, initializer_range=0.15)
    ids, mask = _prompts()
    record = {}
    # a group split over the ranks: rank 0 holds samples 0-1 of prompt A, rank 1 samples 2-3
    split = slice(0, 2) if rank == 0 else slice(2, 4)
    record["split"] = _sample(model, ids[split], mask[split], reuse=False).sequences.tolist()
    # epoch 1: rank 0 samples prompt A's group, rank 1 prompt B's; epoch 2 the other way round
    first, second = (slice(0, 4), slice(4, 8)) if rank == 0 else (slice(4, 8), slice(0, 4))
    record["epoch1"] = _sample(model, ids[first], mask[first], reuse=True).sequences.tolist()
    out2 = _sample(model, ids[second], mask[second], reuse=True)
    record["epoch2"] = out2.sequences.tolist()
    record["rollout_rows"], record["reused"] = out2.dynspec_stats.rollout_rows, out2.dynspec_stats.reused_tokens
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_sample_as_one_process_and_share_rollouts(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    model = tiny_model("llama", seed=0, dtype=torch.float32, initializer_range=0.15)
    ids, mask = _prompts()
    alone = _sample(model, ids, mask, reuse=False).sequences  # one process, all eight rows
    split = torch.tensor(records[0]["split"] + records[1]["split"])
    assert torch.equal(split, alone[:4])  # samples 2-3 on rank 1 are the group's samples 2-3, not twins of 0-1
    assert torch.equal(torch.tensor(records[0]["epoch2"]), alone[4:])
    assert torch.equal(torch.tensor(records[1]["epoch2"]), alone[:4])
    for record in records:  # each rank's second epoch found the other rank's first-epoch samples
        assert record["rollout_rows"] == 4 and record["reused"] > 0
