"""The loop on a CUDA device (skipped without one; `scripts/device_check.sh` runs them where there is one): greedy output
token-identical to plain `generate` on the device, sampled output converging to the target's law, continuous batching,
and timings that wait for the device."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model
from test_sampling import LOOP_NEW, VOCAB, assert_converges, exact_joint, windows
from transformers import (
    ContinuousBatchingConfig,
    GenerationConfig,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import hf_dynspec
from hf_dynspec import DynSpecConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0, dtype=torch.float32).to("cuda")
    return target, perturbed(target, scale=0.1)


CONFIGS = {
    "draft chain": ({}, {}),
    "draft chain, lookahead": ({"draft_lookahead_max_cost": None}, {}),
    "draft tree": ({"tree_node_budget": 6}, {}),
    "lookup chain": ({}, {"lookup": True}),
    "lookup tree": ({"tree_node_budget": 6}, {"lookup": True}),
    "hybrid": ({"proposer": "hybrid"}, {}),
    "default policy": ({"policy": "goodput"}, {}),
}


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_plain_generate_on_cuda(pair, name, batch):
    target, draft = pair
    settings, how = CONFIGS[name]
    ids, mask = left_padded_prompts([5, 9, 7, 12, 6, 8, 10, 11][:batch], seed=3)
    if how.get("lookup"):
        ids, mask = torch.cat([ids, ids[:, -6:], ids[:, -6:]], 1), torch.cat([mask, mask[:, -6:], mask[:, -6:]], 1)
    ids, mask = ids.cuda(), mask.cuda()
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    kwargs = {"prompt_lookup_num_tokens": 4} if how.get("lookup") else {"assistant_model": draft}
    config = DynSpecConfig(**{"policy": "static", "num_speculative_tokens": 4, **settings})
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                          custom_generate=hf_dynspec.speculative_loop, dynspec_config=config, **kwargs)
    assert out.device.type == "cuda" and torch.equal(out, expected)


def test_sampling_follows_the_target_on_cuda():
    target = tiny_model("llama", seed=4, vocab=VOCAB, eos_token_id=None, dtype=torch.float32)
    target.generation_config.eos_token_id = None
    draft = perturbed(target, scale=0.3, seed=8)
    prompt = torch.tensor([3, 4, 5, 3, 2])
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(5)])
    with torch.no_grad():
        joint = exact_joint(target, prompt, processors, LOOP_NEW).reshape([VOCAB] * LOOP_NEW)
    laws = {"first": joint.sum(dim=(3, 4)).reshape(-1), "last": joint.sum(dim=(0, 1)).reshape(-1)}
    target, draft = target.cuda(), draft.cuda()
    torch.manual_seed(0)
    samples: dict[int, torch.Tensor] = {}

    def draw(n: int) -> torch.Tensor:
        if n not in samples:
            ids = prompt.cuda().unsqueeze(0).expand(n, -1)
            out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.9,
                                  top_k=5, top_p=None, max_new_tokens=LOOP_NEW, assistant_model=draft,
                                  custom_generate=hf_dynspec.speculative_loop,
                                  dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=3))
            generated = out[:, prompt.shape[0] :].cpu()  # [n, new]
            samples[n] = (generated * torch.tensor([VOCAB**i for i in reversed(range(LOOP_NEW))])).sum(dim=1)
        return samples[n]

    for window, law in laws.items():
        assert_converges(lambda n, window=window: windows(draw(n))[window], law, sizes=(200, 2_000, 20_000))


def test_continuous_batching_matches_plain_generate_batch_on_cuda(pair):
    target, draft = pair
    generator = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(0, 7, (n,), generator=generator) + 3).tolist() for n in (5, 9, 13, 7)]
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=256)
    expected = target.generate_batch(prompts, generation_config=config, continuous_batching_config=cb)
    for kwargs in ({"prompt_lookup_num_tokens": 4}, {"assistant_model": draft}):
        got = hf_dynspec.generate_batch(target, prompts, generation_config=config, continuous_batching_config=cb,
                                        dynspec_config=DynSpecConfig(policy="static"), **kwargs)
        assert [o.generated_tokens for o in got.values()] == [o.generated_tokens for o in expected.values()]


def test_step_timings_are_the_devices(pair):
    """Draft and verify seconds come from CUDA events: positive, and within the call's total, itself waited for."""
    target, draft = pair
    ids, mask = left_padded_prompts([5, 9], seed=3)
    out = target.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=16, assistant_model=draft,
                          custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True,
                          dynspec_config=DynSpecConfig(policy="static", collect_step_stats=True))
    stats = out.dynspec_stats
    assert stats.steps and all(step.verify_seconds > 0 for step in stats.steps)
    assert 0 < stats.draft_seconds + stats.verify_seconds + stats.prefill_seconds <= stats.total_seconds
