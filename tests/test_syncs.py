"""Host synchronisations per decoding step, counted on the CPU (`hf_dynspec.evaluation.syncs`): each step of the loop
reads the device once (its verification result), whatever the policy; draft lookahead, early stops and draft-model
trees read more, within the budgets below. Continuous batching has budgets of its own. A call that mixes host and
device tensors (an error or a hidden copy on a GPU) fails every configuration."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model
from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.continuous import SpeculativeBatchProcessor
from hf_dynspec.evaluation.syncs import SyncCounter, counting_steps
from hf_dynspec.loop import LoopRun
from hf_dynspec.policies import build_policy

MAX_DRAFT = 4


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=0)
    return target, perturbed(target, scale=0.1)


@pytest.fixture(autouse=True)
def unchecked_trees(monkeypatch):
    """The loop as it runs by default: its trees' structure is not checked (the checks read the device)."""
    monkeypatch.setenv("HF_DYNSPEC_CHECK_TREES", "0")


def count_steps(models, batch: int, lookup: bool = False, sample: bool = False, **settings) -> SyncCounter:
    """The synchronisations of one `generate` call, with a policy built inside the count (the counter takes tensors
    made outside it for device tensors). Draft lookahead is off or not measured: its measurement runs once per
    process, in the step that first drafts."""
    target, draft = models
    ids, mask = left_padded_prompts([5, 9, 7, 12, 6, 8, 10, 11][:batch], seed=3)
    if lookup:  # prompts that repeat themselves, so lookup proposes
        ids, mask = torch.cat([ids, ids[:, -6:], ids[:, -6:]], 1), torch.cat([mask, mask[:, -6:], mask[:, -6:]], 1)
    config = DynSpecConfig(num_speculative_tokens=MAX_DRAFT, **settings)
    kwargs = {"prompt_lookup_num_tokens": MAX_DRAFT} if lookup else {"assistant_model": draft}
    if sample:
        kwargs |= {"do_sample": True, "temperature": 0.9, "top_k": 40}

    def generate(**extra):
        return target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16,
                               custom_generate=hf_dynspec.speculative_loop, dynspec_config=config, **kwargs, **extra)

    counter = SyncCounter()
    with counting_steps(counter, [(LoopRun, "step")]):
        generate(dynspec_policy=build_policy(config))
    return counter


def assert_within(counter: SyncCounter, budget: int, min_steps: int = 3) -> None:
    steps = counter.per_step()
    mixed = [(e.op, e.site) for events in counter.steps for e in events if e.op.startswith("mixed")]
    assert not mixed, f"host and device tensors mixed: {mixed[:5]}"
    assert len(steps) >= min_steps, steps
    over = [(i, n) for i, n in enumerate(steps) if n > budget]
    assert not over, f"steps over {budget} synchronisations: {over}; sites {counter.sites().most_common(6)}"


CHAINS = [
    # name, batch sizes, settings, budget per step
    ("draft", {"policy": "static", "draft_lookahead": 0, "proposer": "draft"}, 1),
    ("draft, sampled", {"policy": "static", "draft_lookahead": 0, "sample": True, "proposer": "draft"}, 1),
    ("draft, goodput", {"draft_lookahead": 0, "proposer": "draft"}, 1),
    ("lookup", {"policy": "static", "lookup": True}, 1),
    ("lookup, sampled", {"policy": "static", "lookup": True, "sample": True}, 1),
    ("lookup, goodput", {"lookup": True}, 1),
    ("lookup tree", {"policy": "static", "lookup": True, "tree_node_budget": 6}, 1),
    ("hybrid", {"policy": "static", "proposer": "hybrid", "draft_lookahead": 0}, 1),
    # draft lookahead reads what each forward drew, to guess the next one's tokens: one read per forward after the first
    ("draft, lookahead", {"policy": "static", "draft_lookahead_max_cost": None, "proposer": "draft"}, 1 + MAX_DRAFT),
    # the default: copies beside the draft (with its lookahead), the goodput policy
    ("default", {"draft_lookahead_max_cost": None}, 1 + MAX_DRAFT),
    # an early stop reads the draft's probability of every token it drew: one read per draft forward
    ("draft, early stop", {"policy": "confidence", "draft_lookahead": 0, "proposer": "draft"}, 1 + MAX_DRAFT),
    # a draft-model tree reads, at each depth, whether to expand and its frontier's mask, then the nodes it keeps
    ("draft tree", {"policy": "static", "tree_node_budget": 6, "draft_lookahead": 0}, 16),
    ("draft tree, sampled", {"policy": "static", "tree_node_budget": 6, "draft_lookahead": 0, "sample": True}, 16),
]


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize(("name", "settings", "budget"), CHAINS, ids=[case[0] for case in CHAINS])
def test_steps_stay_within_their_synchronisation_budget(models, batch, name, settings, budget):
    settings = dict(settings)
    lookup, sample = settings.pop("lookup", False), settings.pop("sample", False)
    assert_within(count_steps(models, batch, lookup, sample, **settings), budget, min_steps=2)


def test_a_chain_step_reads_the_device_once_for_its_verification(models):
    """The one read of a chain step is the verification result (`readback.HostOutcome.read`)."""
    counter = count_steps(models, 8, policy="static", draft_lookahead=0)
    assert list(counter.sites()) == [("to (download)", "hf_dynspec/readback.py:38 (read)")], counter.sites()


def test_the_counter_sees_what_would_synchronise():
    counter = SyncCounter()
    device = torch.arange(6)  # made outside the counter: a device tensor
    with counter:
        host = torch.arange(6)
        int(host[0]), host.tolist(), host[host > 2]  # host values: free
        host.to(device.device, non_blocking=True, copy=True)  # an upload that does not wait
        device[0].item()
        device.tolist()
        bool(device.any())
        device[device > 2]
        device.nonzero()
        device.to("cpu", copy=True)
        torch.tensor([1, 2], device=device.device)  # a blocking upload
        device + host  # a host tensor mixed in
        device + host[0]  # a scalar is fine
    ops = [event.op for event in counter.steps[0]]
    assert ops == ["item", "tolist", "__bool__", "__getitem__ (boolean mask)", "nonzero", "to (download)",
                   "tensor (upload)", "mixed: add"], ops


def test_continuous_batching_steps_stay_within_their_budget(models):
    """Continuous batching reads each drafting request's scores to the host to verify them there, and the
    `cu_seq_lens` of the step to place their trees; transformers' own step (its input tensors, its update) is not
    counted here."""
    target, draft = models
    generator = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(0, 7, (n,), generator=generator) + 3).tolist() for n in (5, 9, 13, 7)]
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=1, pad_token_id=0)
    methods = [(SpeculativeBatchProcessor, name) for name in ("prepare_next_batch", "_generation_step", "update_batch")]
    for kwargs, budget in (({"prompt_lookup_num_tokens": MAX_DRAFT}, 12), ({"assistant_model": draft}, 20)):
        counter = SyncCounter()
        with counting_steps(counter, methods):
            hf_dynspec.generate_batch(
                target, prompts, generation_config=config, dynspec_config=DynSpecConfig(policy="static"),
                continuous_batching_config=ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=256),
                **kwargs,
            )
        steps = [n for n in counter.per_step() if n]
        assert steps and max(steps) <= budget, (steps, counter.sites().most_common(6))
