"""EAGLE-3 heads: exact output with a head as the proposer, the target's states it reads, and clear errors."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, tiny_model
from test_sampling import VOCAB as SMALL_VOCAB
from test_sampling import assert_converges, exact_joint, sample_loop
from transformers import LlamaConfig, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.eagle3 import Eagle3Head, Eagle3Settings, HeadInputs, HeadLoadError, read_config


def random_head(target, draft_vocab: int | None = None, seed: int = 0, aux=None, layers: int = 1, **settings) -> Eagle3Head:
    """A random EAGLE-3 head for `target` whose draft vocabulary is a random subset of `draft_vocab` target ids."""
    text = target.config
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=text.rms_norm_eps,
    )
    draft_vocab = draft_vocab or text.vocab_size
    head = Eagle3Head(config, Eagle3Settings(draft_vocab_size=draft_vocab, aux_layer_ids=aux, **settings))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.3)
        ids = torch.randperm(text.vocab_size)[:draft_vocab].sort().values
        head.d2t.copy_(ids - torch.arange(draft_vocab))
    return head.to(target.dtype).eval()


def generate(target, head, ids, mask, **config):
    return target.generate(
        ids, attention_mask=mask, max_new_tokens=config.pop("new", 24), do_sample=False, assistant_model=head,
        custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True,
        dynspec_config=DynSpecConfig(**config),
    )


@pytest.mark.parametrize(
    ("lengths", "proposer", "k", "draft_vocab"),
    [([7], "draft", 4, None), ([5, 9, 3], "draft", 3, 40), ([6, 6], "auto", 5, 64), ([4, 11, 8, 2], "auto", 2, 20)],
)
def test_greedy_tokens_match_plain_decoding(lengths, proposer, k, draft_vocab):
    target = tiny_model("llama", seed=1, num_hidden_layers=5)
    head = random_head(target, draft_vocab, seed=len(lengths))
    ids, mask = left_padded_prompts(lengths, seed=k)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    out = generate(target, head, ids, mask, proposer=proposer, policy="static", num_speculative_tokens=k)
    assert torch.equal(out.sequences, plain)
    assert out.dynspec_stats.draft_forwards > 0


@pytest.mark.parametrize(("lengths", "budget", "branching", "k"), [([7], 8, 2, 4), ([5, 9, 3], 12, 3, 5), ([6, 6], 4, 2, 3)])
def test_head_trees_give_plain_decodings_tokens(lengths, budget, branching, k):
    target = tiny_model("llama", seed=1, num_hidden_layers=5)
    head = random_head(target, 40, seed=len(lengths))
    ids, mask = left_padded_prompts(lengths, seed=budget)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    out = generate(target, head, ids, mask, policy="static", num_speculative_tokens=k, tree_node_budget=budget,
                   tree_branching=branching)
    assert torch.equal(out.sequences, plain)
    assert out.dynspec_stats.draft_forwards > 0


def test_a_mirror_heads_tree_has_its_best_path_accepted(mirrored):
    """Each frontier node reads its parent's state: with a head that mirrors the target, the tree's best path is the
    target's, so every step accepts its whole depth."""
    target, head = mirrored
    ids, mask = left_padded_prompts([9, 4], seed=5)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = generate(target, head, ids, mask, new=30, policy="static", num_speculative_tokens=4, tree_node_budget=16)
    assert torch.equal(out.sequences, plain)
    steps = out.dynspec_stats.steps
    assert all(accepted == requested for step in steps for accepted, requested in zip(step.accepted, step.requested_lengths))
    assert out.dynspec_stats.target_forwards <= 1 + 2 * (30 // 5 + 1)


def test_a_head_that_mirrors_the_target_has_every_token_accepted(mirrored):
    target, head = mirrored
    ids, mask = left_padded_prompts([9, 4, 12], seed=5)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = generate(target, head, ids, mask, new=30, proposer="draft", policy="static", num_speculative_tokens=4)
    stats = out.dynspec_stats
    assert torch.equal(out.sequences, plain)
    assert stats.accepted_tokens == stats.draft_tokens > 0
    assert stats.target_forwards <= 1 + 3 * (30 // 5 + 1)  # the prefill, then five tokens a verify per row


def record_reads(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every `HeadInputs.before` call from now on: its positions, the committed counts and the states it returned."""
    seen = []
    original = HeadInputs.before

    def spy(self, positions):
        states = original(self, positions)
        seen.append((positions.clone(), self.committed.clone(), states.clone()))
        return states

    monkeypatch.setattr(HeadInputs, "before", spy)
    return seen


def check_reads(seen, mask: torch.Tensor, expected: torch.Tensor, tolerance: float) -> int:
    """Check every recorded state read below a row's committed tokens against `expected` (`[rows, width, hidden]` by
    column of the call's output) at the position before; returns how many were checked."""
    checked = 0
    for positions, committed, states in seen:
        if positions.shape[0] != expected.shape[0]:
            continue  # a forward after some rows finished: rows no longer line up with the call's
        for row in range(positions.shape[0]):
            offset = int((mask[row] == 0).sum())  # left padding before position 0
            for column, position in enumerate(positions[row].tolist()):
                if 0 < position < int(committed[row]):
                    want = expected[row, offset + position - 1]
                    torch.testing.assert_close(states[row, column], want, rtol=tolerance, atol=tolerance)
                    checked += 1
    return checked


def test_the_head_reads_the_targets_states_at_its_layers(monkeypatch):
    """Every state a head forward reads below a row's committed tokens is the target's, fused, at the position before:
    the tap keys what it reads from verify forwards (chains, left padding, rows leaving) by row and position."""
    target = tiny_model("llama", seed=2, num_hidden_layers=6)
    head = random_head(target, aux=[1, 3, 5], seed=4)
    ids, mask = left_padded_prompts([6, 10, 3], seed=2)
    seen = record_reads(monkeypatch)
    out = generate(target, head, ids, mask, proposer="draft", policy="static", num_speculative_tokens=3, new=12)
    sequences = out.sequences
    real = torch.cat([mask, torch.ones_like(sequences[:, mask.shape[1] :])], 1)
    with torch.no_grad():
        positions = (real.cumsum(-1) - 1).clamp(min=0)  # as the loop counts them
        hidden = target(sequences, attention_mask=real, position_ids=positions, output_hidden_states=True).hidden_states
        fused = head.fuse([hidden[i] for i in (1, 3, 5)])  # [rows, width, hidden] by column
    assert check_reads(seen, mask, fused, tolerance=1e-6) > 10


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_with_a_head_as_proposer():
    target = tiny_model("llama", seed=4, vocab=SMALL_VOCAB, eos_token_id=None, num_hidden_layers=4)
    target.generation_config.eos_token_id = None
    head = random_head(target, draft_vocab=4, seed=9)  # q is zero on two of the six tokens
    prompt = torch.tensor([3, 4, 5, 3, 2])
    temperature, top_k = 0.9, 5
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    with torch.no_grad():
        law = exact_joint(target, prompt, processors)
    torch.manual_seed(0)
    samples: dict[int, torch.Tensor] = {}

    def draw(n: int) -> torch.Tensor:
        if n not in samples:
            samples[n] = sample_loop(target, head, prompt, 3, n, temperature, top_k)
        return samples[n]

    assert_converges(draw, law, sizes=(200, 2_000, 20_000))


def test_a_head_that_does_not_fit_the_target_is_refused_with_what_differs():
    target = tiny_model("llama", seed=1, num_hidden_layers=4)
    ids, mask = left_padded_prompts([5], seed=1)
    wider = tiny_model("llama", seed=1, num_hidden_layers=4, hidden_size=48)
    with pytest.raises(HeadLoadError, match="width 48"):
        generate(target, random_head(wider), ids, mask)
    with pytest.raises(HeadLoadError, match=r"auxiliary layer ids \[9\]"):
        generate(target, random_head(target, aux=[1, 2, 9]), ids, mask)


def test_a_config_that_is_no_head_is_refused():
    with pytest.raises(HeadLoadError, match="not an EAGLE-3 head"):
        read_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 32})


@pytest.mark.parametrize(("proposer", "page", "budget", "tree"), [("draft", 16, 256, 0), ("auto", 4, 12, 0), ("draft", 8, 64, 6)])
def test_continuous_batching_with_a_head_gives_generates_tokens(proposer, page, budget, tree):
    """Request by request, `generate_batch` with a head gives what plain decoding gives (small pages put drafts
    across blocks, a small step budget cuts drafts and catch-ups, trees of the chain and its alternatives)."""
    from test_continuous import cb_config, greedy, run, speculating

    target = tiny_model("llama", seed=1, num_hidden_layers=5)
    head = random_head(target, draft_vocab=48, seed=2)
    prompts = [left_padded_prompts([n], seed=n)[0][0].tolist() for n in (5, 9, 13, 7)]
    expected = [target.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False, eos_token_id=1,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    expected = [tokens[: tokens.index(1) + 1] if 1 in tokens else tokens for tokens in expected]
    config = DynSpecConfig(num_speculative_tokens=4, policy="static", proposer=proposer, tree_node_budget=tree)
    manager = speculating(target, generation_config=greedy(30), cb=cb_config(page, max_batch_tokens=budget),
                          dynspec_config=config, assistant_model=head)
    try:
        got = list(run(manager, prompts, 30).values())
    finally:
        manager.stop(block=True)
    assert got == expected
    assert manager.speculation.draft_tokens > 0


def test_continuous_batching_with_a_mirror_head_accepts_every_token(mirrored):
    from test_continuous import greedy, run, speculating

    target, head = mirrored
    target.generation_config.eos_token_id = None
    prompts = [left_padded_prompts([n], seed=n)[0][0].tolist() for n in (6, 11, 4)]
    config = DynSpecConfig(num_speculative_tokens=4, policy="static", proposer="draft")
    manager = speculating(target, generation_config=greedy(25, eos_token_id=None), dynspec_config=config,
                          assistant_model=head)
    try:
        run(manager, prompts, 25)
    finally:
        manager.stop(block=True)
    stats = manager.speculation
    assert stats.accepted_tokens == stats.draft_tokens > 0


def test_the_bench_names_a_head_method_by_its_options():
    from hf_dynspec.evaluation.methods import MethodError, parse_method

    method = parse_method("dynspec-head@solo:6", {"head@solo": {"draft_head": "org/head", "proposer": "draft"}})
    config = method.dynspec_config
    assert (config.draft_head, config.proposer, config.num_speculative_tokens, method.uses_draft) == (
        "org/head", "draft", 6, False
    )
    with pytest.raises(MethodError, match="head.draft_head="):
        parse_method("dynspec-head", {})
