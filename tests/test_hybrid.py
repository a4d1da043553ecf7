"""The hybrid proposer (prompt lookup or the draft model, per row and step): greedy identity and exact sampling."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model
from test_sampling import NEW, VOCAB, assert_converges, exact_joint, small_vocab_pair  # noqa: F401 (fixture)
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.candidates.prompt_lookup import lookup_match
from hf_dynspec.policies import DraftLengthPolicy, PolicyInput


class AlternatingSources(DraftLengthPolicy):
    """Drafts `k` tokens per row; even rows take prompt lookup on even steps, odd rows on odd steps."""

    def __init__(self, k: int) -> None:
        self.k = k

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        return torch.full((request.batch_size,), self.k, dtype=torch.long)

    def free_rows(self, request: PolicyInput) -> torch.BoolTensor:
        return (request.row_ids + request.step) % 2 == 0


def repetitive_prompts(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = left_padded_prompts(lengths, seed=seed)
    return torch.where(mask.bool(), ids % 5 + 3, ids), mask  # a small alphabet makes n-gram matches frequent


def generate(target, ids, mask, draft=None, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", ["static", "goodput", "alternating"])
@pytest.mark.parametrize("lengths", [[9], [6, 11, 15], [5, 8, 12, 7, 10]])
def test_hybrid_matches_plain_greedy(family, policy, lengths):
    target = tiny_model(family, seed=0)
    draft = perturbed(target, scale=0.05)
    ids, mask = repetitive_prompts(lengths, seed=len(lengths))
    expected = generate(target, ids, mask)
    config = DynSpecConfig(num_speculative_tokens=4, proposer="hybrid",
                           policy="goodput" if policy == "goodput" else "static")
    out = generate(
        target, ids, mask, assistant_model=draft, custom_generate=hf_dynspec.speculative_loop, dynspec_config=config,
        dynspec_policy=AlternatingSources(3) if policy == "alternating" else None, return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, expected)
    steps = [s for s in out.dynspec_stats.steps if s.free_rows is not None]
    if policy != "goodput":  # every step drafts: both sources must have served some rows
        served = [free for s in steps for free, k in zip(s.free_rows, s.draft_lengths) if k > 0]
        assert any(served) and not all(served)


def test_rows_served_by_lookup_do_not_run_the_draft():
    target = tiny_model("llama", seed=0)
    ids, mask = repetitive_prompts([12, 14], seed=3)

    class LookupOnly(AlternatingSources):
        """Drafts only what prompt lookup offers."""

        def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
            return request.free_lengths.clamp(max=self.k)

        def free_rows(self, request: PolicyInput) -> torch.BoolTensor:
            return torch.ones(request.batch_size, dtype=torch.bool)

    out = generate(
        target, ids, mask, assistant_model=perturbed(target, 0.05), custom_generate=hf_dynspec.speculative_loop,
        dynspec_config=DynSpecConfig(num_speculative_tokens=4, proposer="hybrid"), dynspec_policy=LookupOnly(4),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, generate(target, ids, mask))
    assert out.dynspec_stats.draft_forwards == 0 and out.dynspec_stats.draft_tokens > 0


def test_lookup_rows_are_capped_by_lookup_tokens_and_draft_rows_by_speculative_tokens():
    target = tiny_model("qwen2", seed=0)
    ids, mask = repetitive_prompts([14, 10, 16], seed=5)
    config = DynSpecConfig(num_speculative_tokens=2, prompt_lookup_max_tokens=7, proposer="hybrid", draft_lookahead=0)
    out = generate(
        target, ids, mask, assistant_model=perturbed(target, 0.05), custom_generate=hf_dynspec.speculative_loop,
        dynspec_config=config, dynspec_policy=AlternatingSources(9), return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, generate(target, ids, mask))
    served = [(free, k) for s in out.dynspec_stats.steps if s.free_rows for free, k in zip(s.free_rows, s.draft_lengths)]
    assert max(k for free, k in served if not free) == 2  # the policy asked for 9: the draft model stops at 2
    by_lookup = [k for free, k in served if free]
    assert max(by_lookup) <= 7 and any(k > 2 for k in by_lookup)


def test_hybrid_needs_a_draft_model():
    target = tiny_model("llama", seed=0)
    ids, mask = repetitive_prompts([6], seed=0)
    with pytest.raises(ValueError, match="proposer='hybrid'"):
        generate(target, ids, mask, prompt_lookup_num_tokens=3, custom_generate=hf_dynspec.speculative_loop,
                 dynspec_config=DynSpecConfig(proposer="hybrid"))


def test_unknown_proposer_is_refused():
    with pytest.raises(ValueError, match="`proposer` must be one of"):
        DynSpecConfig(proposer="trie")


@pytest.mark.slow
@pytest.mark.parametrize("k", [2])
def test_hybrid_samples_follow_target_distribution(small_vocab_pair, k):  # noqa: F811
    target, draft = small_vocab_pair
    prompt = torch.tensor([3, 4, 5, 3, 4, 5, 3, 4])  # lookup finds continuations; the draft serves the other rows
    temperature, top_k = 0.9, 5
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    with torch.no_grad():
        joint = exact_joint(target, prompt, processors)

    def draw(n: int) -> torch.Tensor:
        ids = prompt.unsqueeze(0).expand(n, -1)
        out = target.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature, top_k=top_k,
            top_p=None, max_new_tokens=NEW, assistant_model=draft, custom_generate=hf_dynspec.speculative_loop,
            dynspec_config=DynSpecConfig(num_speculative_tokens=k, proposer="hybrid"),
            dynspec_policy=AlternatingSources(k),
        )
        generated = out[:, prompt.shape[0] :]
        return (generated * torch.tensor([VOCAB**i for i in reversed(range(NEW))])).sum(dim=1)

    torch.manual_seed(0)
    assert_converges(draw, joint, sizes=(200, 2_000, 20_000))


def test_lookup_anchor_is_the_suffix_a_row_shares_with_its_continuations_source() -> None:
    """`lookup_match` against a brute-force reference over many random rows of a small alphabet."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        tokens = torch.randint(0, 3 + trial % 4, (int(torch.randint(2, 40, (1,), generator=generator)),),
                               generator=generator)
        max_anchor = int(torch.randint(0, 12, (1,), generator=generator))
        continuation, anchor = lookup_match(tokens, 3, 1, 5, max_anchor)
        expected = reference_lookup(tokens.tolist(), 3, 1, 5, max_anchor)
        assert (continuation.tolist(), anchor) == expected, (tokens.tolist(), max_anchor)


def reference_lookup(tokens: list[int], max_ngram: int, min_ngram: int, length: int, max_anchor: int):
    n = len(tokens)
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        starts = [i for i in range(n - size) if tokens[i : i + size] == tokens[n - size :]]
        if starts:
            start = starts[-1] + size  # the latest occurrence, ending before the row's final token
            anchor = size
            while anchor < min(max_anchor, start) and tokens[start - anchor - 1] == tokens[n - anchor - 1]:
                anchor += 1
            return tokens[start : start + length], anchor
    return [], 0


def test_anchors_need_the_steps_lookup_first():
    from types import SimpleNamespace

    from hf_dynspec.candidates.hybrid import HybridProposer
    from hf_dynspec.candidates.prompt_lookup import PromptLookupProposer

    proposer = HybridProposer(draft=None, free=PromptLookupProposer())  # the draft model plays no part here
    with pytest.raises(RuntimeError, match="call that first"):
        proposer.free_anchors(SimpleNamespace(batch_size=2))  # a step's rows, before `free_lengths` looked them up
