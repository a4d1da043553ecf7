"""The draft's output layer over part of the vocabulary: same logits where kept, lossless greedy and sampling."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, VOCAB, left_padded_prompts, perturbed, tiny_model
from test_sampling import NEW, assert_converges, exact_joint, small_vocab_pair  # noqa: F401 (fixture)
from test_sampling import VOCAB as SMALL_VOCAB
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GenerationConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.candidates.draft_head import DraftHead, unsupported_reason
from hf_dynspec.candidates.draft_model import DraftModelProposer
from hf_dynspec.placement import Placement
from hf_dynspec.sequences import TokenBatch


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_kept_ids_get_the_models_own_logits_and_the_rest_minus_infinity(family):
    model = tiny_model(family, seed=2)
    prompts = torch.tensor([[5, 70, 71, 5], [90, 6, 7, 8]])  # [2, 4] ids 70, 71 and 90 lie past the first 40
    head = DraftHead.for_batch(model, 40, prompts, [EOS, 93])
    assert head is not None and head.num_kept == 40 + 4  # 70, 71, 90 from the prompts, 93 from the EOS ids
    kept = torch.zeros(VOCAB, dtype=torch.bool)
    kept[:40] = True
    kept[[70, 71, 90, 93]] = True
    ids = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))  # [3, 6]
    with torch.no_grad():
        full = model(input_ids=ids).logits.float()  # [3, 6, vocab]
        narrowed = head.logits(head.decoder(input_ids=ids).last_hidden_state)  # [3, 6, vocab]
    torch.testing.assert_close(narrowed[..., kept], full[..., kept])
    assert torch.isneginf(narrowed[..., ~kept]).all()


def test_no_head_when_it_would_keep_the_whole_vocabulary_or_is_not_asked_for(llama):
    prompts = torch.tensor([[5, 6]])
    assert DraftHead.for_batch(llama, None, prompts, [EOS]) is None
    assert DraftHead.for_batch(llama, VOCAB, prompts, [EOS]) is None
    assert DraftHead.for_batch(llama, VOCAB - 1, prompts, [EOS]).num_kept == VOCAB - 1


def test_models_that_transform_their_logits_keep_the_whole_vocabulary():
    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, final_logit_softcapping=2.0, pad_token_id=0, eos_token_id=EOS,
    )
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(config).double().eval()
    assert "final_logit_softcapping" in unsupported_reason(gemma)  # soft-capped: tanh after the output layer
    assert DraftHead.for_batch(gemma, 16, torch.tensor([[5, 6]]), [EOS]) is None
    gemma.config.final_logit_softcapping = None
    assert unsupported_reason(gemma) is not None  # checked once per model, not per call


class ScaledLlama(LlamaForCausalLM):
    """Scales its logits after the output layer without a config field saying so."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 3.0
        return output


def test_a_transform_no_config_names_is_found_by_comparing_logits(llama):
    scaled = ScaledLlama(llama.config).double().eval()
    scaled.load_state_dict(llama.state_dict())
    assert "not a plain linear map" in unsupported_reason(scaled)
    assert unsupported_reason(llama) is None


def test_a_draft_with_a_narrowed_head_proposes_only_kept_ids(llama):
    draft = perturbed(llama, scale=0.05)
    ids, _ = left_padded_prompts([12, 12], seed=5)
    n, width = ids.shape
    tokens = torch.cat([ids, torch.zeros((n, 6), dtype=torch.long)], dim=1)
    batch = TokenBatch(tokens, width, torch.full((n,), width), torch.zeros(n, dtype=torch.long), 0)
    config = DynSpecConfig(num_speculative_tokens=6, draft_vocab_size=8, draft_lookahead=0)
    proposer = DraftModelProposer(draft, LogitsProcessorList(), GenerationConfig(eos_token_id=EOS),
                                  Placement.of(torch.device("cpu"), llama, draft), config)
    proposer.start(batch)
    with torch.no_grad():
        proposal = proposer.propose(batch, torch.full((n,), 6))
    kept = set(range(8)) | set(ids.flatten().tolist()) | {EOS}
    assert proposal.lengths.eq(6).all()
    assert set(proposal.tokens.flatten().tolist()) <= kept
    assert len(kept) < VOCAB // 2  # the head really narrowed the vocabulary


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    ("lengths", "policy", "tree_node_budget"),
    [([9], "static", 0), ([5, 14, 8], "goodput", 0), ([7, 11, 4, 13, 6], "static", 0), ([6, 10], "goodput", 6)],
)
def test_greedy_output_is_unchanged_with_a_narrowed_draft(family, lengths, policy, tree_node_budget):
    target = tiny_model(family, seed=1, eos_token_id=4)
    draft = perturbed(target, scale=0.1, seed=3)
    ids, mask = left_padded_prompts(lengths, seed=len(lengths))
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    for size in (None, 24):
        config = DynSpecConfig(policy=policy, num_speculative_tokens=4, draft_vocab_size=size, compact_min_holes=2,
                               compact_hole_fraction=0.05, tree_node_budget=tree_node_budget)
        out = target.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=40, assistant_model=draft,
            custom_generate=hf_dynspec.speculative_loop, dynspec_config=config, return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, plain)


@pytest.mark.slow
def test_sampling_with_a_narrowed_draft_follows_the_target_distribution(small_vocab_pair):  # noqa: F811
    """Ids 4 and 5 are outside the draft's kept ids (the first 2, and 2 and 3 from the prompt), so they reach the
    output only through the residual distribution: the samples must still follow the target exactly."""
    target, draft = small_vocab_pair
    prompt = torch.tensor([3, 2, 3, 3, 2])
    head = DraftHead.for_batch(draft, 2, prompt.unsqueeze(0), [])
    assert head is not None and head.num_kept == 4
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(5)])
    with torch.no_grad():
        joint = exact_joint(target, prompt, processors)

    def draw(n: int) -> torch.Tensor:
        ids = prompt.unsqueeze(0).expand(n, -1)
        out = target.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.9, top_k=5, top_p=None,
            max_new_tokens=NEW, assistant_model=draft, custom_generate=hf_dynspec.speculative_loop,
            dynspec_config=DynSpecConfig(num_speculative_tokens=3, draft_vocab_size=2),
        )
        generated = out[:, prompt.shape[0] :]  # [n, NEW]
        return (generated * torch.tensor([SMALL_VOCAB**i for i in reversed(range(NEW))])).sum(dim=1)

    torch.manual_seed(0)
    assert_converges(draw, joint, sizes=(200, 2_000, 20_000))


def test_draft_vocab_size_must_be_positive():
    with pytest.raises(ValueError, match="`draft_vocab_size` must be an integer >= 1"):
        DynSpecConfig(draft_vocab_size=0)


def test_the_bench_counts_every_forward_of_a_narrowed_draft(llama):
    from hf_dynspec.calibration import affordable_lookahead
    from hf_dynspec.evaluation.runner import ForwardCounter
    from hf_dynspec.kernels import linear_plan

    draft = perturbed(llama, scale=0.05, seed=11)
    ids, mask = left_padded_prompts([8, 12], seed=3)
    counter = ForwardCounter(draft)
    config = DynSpecConfig(policy="static", num_speculative_tokens=3, draft_vocab_size=24)
    assert unsupported_reason(draft) is None  # the check runs forwards of its own, once per model
    plan = linear_plan(draft, config.narrow_linear)  # so does timing the lookahead's forwards
    affordable_lookahead(draft, config.draft_lookahead, config.draft_lookahead_max_cost, plan)
    counter.take()
    out = llama.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True, dynspec_config=config,
    )
    assert counter.take() == out.dynspec_stats.draft_forwards > 0
    counter.remove()


def test_a_slice_of_hidden_states_takes_one_product(llama):
    """The last positions of a wider block (as a catch-up or a lookahead forward keeps them) reach the narrowed head
    as a slice; it is multiplied in one product (no copy of the weight), with the logits of the whole block's rows."""
    from test_kernels import _Ops

    model = tiny_model("llama", seed=4).requires_grad_(False)
    head = DraftHead.for_batch(model, 40, torch.tensor([[70, 5]]), [EOS])
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = head.decoder(input_ids=ids).last_hidden_state  # [1, 6, hidden]
        whole = head.logits(hidden)
        with _Ops() as ops:
            last = head.logits(hidden[:, -2:])  # [1, 2, vocab]
    assert "bmm" not in ops.names
    torch.testing.assert_close(last, whole[:, -2:])
