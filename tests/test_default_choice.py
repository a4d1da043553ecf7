"""The default's choice between copies and the draft model, end to end on tiny models at fixed step costs.

The target is a successor model: its attention and MLP outputs are zero, so its next token is a fixed function of
the current one (a single cycle through the vocabulary). A prompt that holds a stretch of that cycle makes copies
from the context right until the stretch breaks; a clone of the target as the draft is accepted always, a heavily
perturbed one almost never. The step costs are fixed (`PaddedCostModel`: a verify forward 1 s at any width up to 64
tokens, a draft forward `DRAFT_SECONDS`), so what the policy learns is acceptance alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import PAD, VOCAB, perturbed, tiny_model

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.cost_models import PaddedCostModel, PiecewiseLinear
from hf_dynspec.policies import GoodputPolicy, GoodputSettings

DRAFT_SECONDS = 0.1
FIRST_TOKEN = 3  # ids below are pad, EOS and BOS: never generated


def successor_model(seed: int = 0) -> tuple[torch.nn.Module, dict[int, int]]:
    """A tiny llama whose greedy next token is `successor[current]`, a cycle through ids 3..VOCAB-1."""
    model = tiny_model("llama", seed=seed)
    generator = torch.Generator().manual_seed(seed)
    order = (torch.randperm(VOCAB - FIRST_TOKEN, generator=generator) + FIRST_TOKEN).tolist()
    successor = {token: order[(i + 1) % len(order)] for i, token in enumerate(order)}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding = torch.nn.functional.normalize(model.model.embed_tokens.weight, dim=-1)
        model.model.embed_tokens.weight.copy_(embedding)
        head = torch.zeros_like(model.lm_head.weight)
        for token, after in successor.items():
            head[after] = embedding[token]
        model.lm_head.weight.copy_(head)
    return model, successor


def cycle_prompt(successor: dict[int, int], start: int, length: int, broken_every: int | None) -> torch.Tensor:
    """`[1, length + 4]`: a stretch of the cycle from `start` (every `broken_every`-th token replaced by another),
    three filler tokens, then `start` again, so the answer walks the stretch."""
    stretch, token = [], start
    for i in range(length):
        broken = broken_every is not None and i % broken_every == broken_every - 1
        stretch.append(FIRST_TOKEN + (token - FIRST_TOKEN + 7) % (VOCAB - FIRST_TOKEN) if broken else token)
        token = successor[token]
    filler = [FIRST_TOKEN + (start + 11 * k) % (VOCAB - FIRST_TOKEN) for k in range(1, 4)]
    return torch.tensor([stretch + filler + [start]])


def fixed_costs() -> PaddedCostModel:
    return PaddedCostModel(PiecewiseLinear.fit({1: (1.0, 1), 64: (1.0, 1)}), PiecewiseLinear.fit({1: (DRAFT_SECONDS, 1)}))


def steps_by_source(target, draft, ids: torch.Tensor, new_tokens: int) -> tuple[int, int, int]:
    """(steps that ran the draft model, steps that only copied, plain steps) of the default on `ids`, after
    checking its tokens against plain greedy decoding."""
    mask = (ids != PAD).long()
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens)
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                              assistant_model=draft, return_dict_in_generate=True,
                              dynspec_policy=GoodputPolicy(GoodputSettings(), cost_model=fixed_costs()),
                              dynspec_config=DynSpecConfig(num_speculative_tokens=8))
    assert torch.equal(out.sequences, expected)
    drafted = copied = 0
    for step in out.dynspec_stats.steps:
        free = step.free_rows or [False] * len(step.row_ids)
        ran = any(k > 0 and not f for k, f in zip(step.draft_lengths, free))
        drafted += ran
        copied += not ran and any(k > 0 and f for k, f in zip(step.draft_lengths, free))
    return drafted, copied, len(out.dynspec_stats.steps) - drafted - copied


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_default_drafts_where_a_sure_draft_beats_moderate_copies(seed: int) -> None:
    """Copies right for three tokens in four; the draft always right and cheap (9 tokens for 1.4 s at 8 draft
    tokens, against about 3 for 1 s from copies): the default ends up drafting on most steps."""
    target, successor = successor_model(seed)
    ids = cycle_prompt(successor, start=FIRST_TOKEN + 5 * seed, length=80, broken_every=4)
    drafted, copied, plain = steps_by_source(target, copy.deepcopy(target), ids, new_tokens=64)
    assert drafted >= 0.7 * (drafted + copied + plain), (drafted, copied, plain)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_default_copies_where_copies_are_right_and_the_draft_is_poor(seed: int) -> None:
    """Copies always right; a draft that is almost never right: the default copies on most steps and runs the
    draft on few (the first steps measure it)."""
    target, successor = successor_model(seed)
    ids = cycle_prompt(successor, start=FIRST_TOKEN + 5 * seed, length=80, broken_every=None)
    drafted, copied, plain = steps_by_source(target, perturbed(target, scale=5.0), ids, new_tokens=64)
    assert copied >= 0.7 * (drafted + copied + plain), (drafted, copied, plain)
    assert drafted <= 3, (drafted, copied, plain)
