"""Coupled sampling: the hash, streams, the exact law of sampled tokens, and invariance to proposers and batches."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model
from scipy import stats
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.coupling import (
    GUMBEL_MAX,
    REUSE_SEED,
    RowKeys,
    batch_keys,
    coupled_choice,
    gumbel_noise,
    mix32,
    perturb,
    prompt_digest,
    response_keys,
    sample_indices,
    stream_keys,
    stream_of,
    token_keys,
)
from hf_dynspec.sequences import TokenBatch


# ---- the hash ------------------------------------------------------------------------------------------------------
def _mix32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def test_mix32_is_exact_32_bit_arithmetic():
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 123456789, 0xDEADBEEF]
    assert mix32(torch.tensor(values)).tolist() == [_mix32_reference(v) for v in values]


def test_mix32_is_a_bijection_on_a_block():
    block = torch.arange(1 << 16) * 65537  # distinct 32-bit values
    assert mix32(block).unique().numel() == block.numel()


def test_noise_is_gumbel_and_independent_across_ids_and_keys():
    streams = torch.tensor([5, 5, 6, 7]).repeat_interleave(500)
    positions = torch.arange(2000)
    noise = gumbel_noise(streams, positions, 512)  # [2000, 512]
    uniform = torch.exp(-torch.exp(-noise.double())).flatten().numpy()
    assert stats.kstest(uniform, "uniform").pvalue > 1e-3
    pairs = torch.corrcoef(torch.stack([noise[:-1, 0], noise[1:, 0], noise[:-1, 1], noise[:-1, 511]]))
    assert (pairs - torch.eye(4)).abs().max() < 0.1


def test_token_keys_are_distinct_within_a_stream():
    first, second = token_keys(torch.full((4096,), 12345), torch.arange(4096))
    assert (first * (1 << 32) + second).unique().numel() == 4096


@pytest.mark.slow
def test_coupled_choice_samples_softmax():
    """The perturbed argmax over many keys follows `softmax(scores)` (-inf scores never win)."""
    scores = torch.tensor([1.0, 0.0, -1.0, float("-inf"), 2.0])
    n = 200_000
    tokens = coupled_choice(scores.expand(n, -1), torch.full((n,), 99), torch.arange(n))
    counts = torch.bincount(tokens, minlength=5).double().numpy()
    expected = scores.double().softmax(-1).numpy() * n
    assert counts[3] == 0
    assert stats.chisquare(counts[[0, 1, 2, 4]], expected[[0, 1, 2, 4]]).pvalue > 1e-3


@pytest.mark.parametrize("spread", [0.1, 3.0, 30.0])
def test_the_perturbed_argmax_hashes_candidates_only_and_matches_the_dense_one(spread):
    """`coupled_choice` hashes only tokens that can still win; its choice is the dense `argmax(scores + noise)`
    whatever the spread of the scores (flat ones make most tokens candidates), with `-inf` (top-k) scores and over
    more items than one block."""
    generator = torch.Generator().manual_seed(int(spread * 10))
    scores = torch.randn((3, 7, 4000), generator=generator) * spread  # [3, 7] items of 4000 ids
    scores[0, :, 100:] = float("-inf")  # top-k: only 100 ids allowed
    streams = torch.arange(21).view(3, 7) * 101
    positions = torch.arange(7).expand(3, -1) + 5
    dense = scores + gumbel_noise(streams.reshape(-1), positions.reshape(-1), 4000).view(3, 7, 4000)
    assert torch.equal(coupled_choice(scores, streams, positions), dense.argmax(dim=-1))
    assert torch.equal(perturb(scores, streams, positions).argmax(dim=-1), dense.argmax(dim=-1))
    assert int(coupled_choice(scores, streams, positions)[0].max()) < 100


def test_the_noise_never_reaches_its_bound():
    noise = gumbel_noise(torch.arange(64), torch.arange(64), 1 << 16)  # 4 million draws
    assert float(noise.max()) < GUMBEL_MAX and bool(torch.isfinite(noise).all())


# ---- streams -------------------------------------------------------------------------------------------------------
def test_streams_follow_seed_prompt_and_index():
    prompts = [[5, 6, 7], [5, 6, 7], [8], [5, 6, 7]]
    streams = stream_keys(prompts, seed=0).tolist()
    assert len(set(streams)) == 4  # the three samples of [5, 6, 7] are indices 0, 1, 2
    assert streams == stream_keys(prompts, seed=0).tolist()
    assert set(streams).isdisjoint(stream_keys(prompts, seed=1).tolist())
    assert stream_keys([[8], [5, 6, 7]], seed=0).tolist() == [streams[2], streams[0]]  # order within a call free
    assert all(0 <= s < 1 << 63 for s in streams)


def test_sample_indices_count_earlier_rows_with_the_same_prompt():
    a, b = prompt_digest([1, 2]), prompt_digest([3])
    assert sample_indices([a, b, a, a]) == [0, 0, 1, 2]
    assert sample_indices([a, b, a], offsets={a: 4}) == [4, 0, 5]
    assert stream_of(0, a, 4) != stream_of(0, a, 5)


def test_padding_does_not_change_a_rows_stream():
    ids, mask = left_padded_prompts([3, 6], seed=2)
    wide = torch.cat([torch.zeros((2, 4), dtype=torch.long), ids], dim=1)
    wide_mask = torch.cat([torch.zeros((2, 4), dtype=torch.long), mask], dim=1)
    model = tiny_model("llama", seed=0, dtype=torch.float32)
    runs = [_sample(model, i, m, max_new_tokens=8) for i, m in ((ids, mask), (wide, wide_mask))]
    assert torch.equal(runs[0][:, ids.shape[1] :], runs[1][:, wide.shape[1] :])


# ---- keys --------------------------------------------------------------------------------------------------------------
def _random_row(generator: torch.Generator) -> tuple[list[int], list[int]]:
    """A prompt of 1-6 tokens and a response of 1-40 over a vocabulary of 3: windows repeat often."""
    prompt = torch.randint(0, 3, (int(torch.randint(1, 7, (1,), generator=generator)),), generator=generator)
    response = torch.randint(0, 3, (int(torch.randint(1, 41, (1,), generator=generator)),), generator=generator)
    return prompt.tolist(), response.tolist()


def test_context_keys_never_repeat_within_a_row_and_grow_with_the_row():
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        prompt, response = _random_row(generator)
        host = response_keys(prompt, response, "context")
        assert len(set(host)) == len(host)
        n = len(response)
        cut = int(torch.randint(0, n + 1, (1,), generator=generator))
        keys = RowKeys(prompt, "context")
        keys.extend(response[:cut])
        assert keys.along(response[cut:])[: n - cut] == host[cut:]
    assert response_keys([1, 2], [5, 6, 7], "position") == [0, 1, 2]


def test_a_context_key_follows_the_last_four_tokens_and_their_count():
    keys = response_keys([9, 9, 9, 9], [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 0, 1, 2, 3, 4, 5], "context")
    windows = [key & 0xFFFFFFFF for key in keys]
    assert windows[9] == windows[4] and windows[15] == windows[4]  # after 1 2 3 4, three times
    assert [keys[i] >> 32 for i in (4, 9, 15)] == [0, 1, 2]
    assert windows[5] != windows[10]  # after 2 3 4 5 and after 3 4 6 0


def test_batch_keys_of_paths_after_left_padded_rows_match_the_host():
    """The loop's keys (committed tokens of left-padded rows, then a draft path) are those of the whole sequence."""
    generator = torch.Generator().manual_seed(1)
    rows = [_random_row(generator) for _ in range(5)]
    width = max(len(prompt) for prompt, _ in rows)
    capacity = max(len(response) for _, response in rows)
    tokens = torch.zeros((5, width + capacity), dtype=torch.long)
    for row, (prompt, response) in enumerate(rows):
        tokens[row, width - len(prompt) : width] = torch.tensor(prompt)
        committed = response[: len(response) // 2]
        tokens[row, width : width + len(committed)] = torch.tensor(committed, dtype=torch.long)
    batch = TokenBatch(tokens, width, torch.tensor([len(p) for p, _ in rows]),
                       torch.tensor([len(r) // 2 for _, r in rows]), pad_id=0)
    depth = max(len(r) - len(r) // 2 for _, r in rows)
    path = torch.zeros((5, depth), dtype=torch.long)
    for row, (_, response) in enumerate(rows):
        rest = response[len(response) // 2 :]
        path[row, : len(rest)] = torch.tensor(rest)
    for drawn in range(depth):
        along = torch.tensor([min(drawn, len(r) - len(r) // 2 - 1) for _, r in rows])
        for keying in ("context", "position"):
            keys = batch_keys(batch, torch.arange(5), path, along, keying)
            expected = [response_keys(p, r, keying)[len(r) // 2 + int(k)] for (p, r), k in zip(rows, along)]
            assert keys.tolist() == expected


# ---- the law of sampled tokens ---------------------------------------------------------------------------------------
VOCAB, NEW = 6, 3


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_model("llama", seed=4, vocab=VOCAB, eos_token_id=None)
    target.generation_config.eos_token_id = None
    return target, perturbed(target, scale=0.4, seed=8)


def exact_joint(model, prompt: torch.Tensor, processors: LogitsProcessorList) -> torch.Tensor:
    """`[VOCAB ** NEW]` probability of every continuation of `NEW` tokens under `model` with `processors`."""
    joint, prefixes = torch.ones(1, dtype=torch.float64), prompt.unsqueeze(0)
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(prefixes).logits[:, -1].double()
            joint = (joint.unsqueeze(1) * processors(prefixes, logits).softmax(dim=-1)).reshape(-1)
            prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(len(prefixes))[:, None]], 1)
    return joint


def chi_square_pvalue(codes: torch.Tensor, law: torch.Tensor) -> float:
    """Pearson's test of `codes` (`[n]` continuation codes) against `law`; cells expecting fewer than 5 pooled."""
    counts = torch.bincount(codes, minlength=law.shape[0]).double()
    expected = law.double() * codes.shape[0]
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    if float(expected[-1]) == 0.0:
        observed, expected = observed[:-1], expected[:-1]
    return float(stats.chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue)


SETTINGS = {
    "temperature": dict(temperature=0.8, top_k=None, top_p=None),
    "top-k": dict(temperature=1.0, top_k=3, top_p=None),
    "top-p": dict(temperature=1.0, top_k=None, top_p=0.8),
    "repetition penalty": dict(temperature=1.0, top_k=None, top_p=None, repetition_penalty=1.5),
}


def processors_for(settings: dict) -> LogitsProcessorList:
    """The processors plain `generate` builds for `settings` (same order)."""
    out = LogitsProcessorList()
    if settings.get("repetition_penalty"):
        out.append(RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]))
    if settings["temperature"] != 1.0:
        out.append(TemperatureLogitsWarper(settings["temperature"]))
    if settings["top_k"]:
        out.append(TopKLogitsWarper(settings["top_k"]))
    if settings["top_p"]:
        out.append(TopPLogitsWarper(settings["top_p"]))
    return out


def coupled_codes(
    target, draft, prompt, settings: dict, n: int, seed: int, keying: str = "context"
) -> torch.Tensor:
    """`[n]` codes of the `NEW` tokens that `n` rows with `prompt` sample (rows are indices 0 .. n - 1: n streams)."""
    ids = prompt.unsqueeze(0).expand(n, -1)
    config = DynSpecConfig(sampling="coupled", seed=seed, policy="static", num_speculative_tokens=2,
                           coupling_keys=keying)
    out = hf_dynspec.generate(
        target, input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=NEW,
        assistant_model=draft, dynspec_config=config, **settings,
    )
    return (out[:, prompt.shape[0] :] * torch.tensor([VOCAB**2, VOCAB, 1])).sum(dim=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*SETTINGS, "temperature, position keys"])
def test_coupled_samples_follow_the_target_joint_law(small_pair, name):
    """Three consecutive tokens sampled through the loop with a draft: Pearson's test does not reject the exact law."""
    target, draft = small_pair
    prompt = torch.tensor([3, 4, 5, 3, 2])
    setting, _, keys = name.partition(", ")
    law = exact_joint(target, prompt, processors_for(SETTINGS[setting]))
    codes = coupled_codes(target, draft, prompt, SETTINGS[setting], n=6000, seed=11,
                          keying="position" if keys else "context")
    assert chi_square_pvalue(codes, law) > 1e-3


def test_the_law_test_rejects_a_sampler_that_resamples_after_lenient_rejection(small_pair):
    """Power check: SPEC-RL's rule (accept the old policy's token with min(1, p_new / p_old), else resample from
    p_new, not from the residual) returns tokens that do not follow p_new; the same test with as many samples
    rejects them."""
    target, old = small_pair
    prompt = torch.tensor([3, 4, 5, 3, 2])
    processors = processors_for(SETTINGS["temperature"])
    generator = torch.Generator().manual_seed(0)
    n, rows = 6000, prompt.unsqueeze(0).repeat(6000, 1)
    with torch.no_grad():
        for _ in range(NEW):
            p_new = processors(rows, target(rows).logits[:, -1].double()).softmax(-1)
            p_old = processors(rows, old(rows).logits[:, -1].double()).softmax(-1)
            proposed = torch.multinomial(p_old, 1, generator=generator)  # [n, 1]
            ratio = (p_new.gather(1, proposed) / p_old.gather(1, proposed)).clamp(max=1.0)
            accept = torch.rand((n, 1), generator=generator, dtype=torch.float64) < ratio
            token = torch.where(accept, proposed, torch.multinomial(p_new, 1, generator=generator))
            rows = torch.cat([rows, token], dim=1)
    codes = (rows[:, prompt.shape[0] :] * torch.tensor([VOCAB**2, VOCAB, 1])).sum(dim=1)
    assert chi_square_pvalue(codes, exact_joint(target, prompt, processors)) < 1e-6


# ---- invariance --------------------------------------------------------------------------------------------------------
def _sample(model, ids, mask, config: dict | None = None, **kwargs) -> torch.Tensor:
    settings = dict(do_sample=True, temperature=1.0, top_k=None, top_p=None, max_new_tokens=24)
    settings.update(kwargs)
    config = DynSpecConfig(**{"sampling": "coupled", "seed": 3, **(config or {})})
    return hf_dynspec.generate(model, input_ids=ids, attention_mask=mask, dynspec_config=config, **settings)


@pytest.fixture(scope="module")
def pair32():
    target = tiny_model("llama", seed=0, dtype=torch.float32, initializer_range=0.15)
    return target, perturbed(target, scale=0.2)


@pytest.fixture(scope="module")
def batch():
    ids, mask = left_padded_prompts([5, 9, 5, 3, 7, 6], seed=1)
    ids[2], mask[2] = ids[0], mask[0]  # a group: the same prompt twice (indices 0 and 1)
    return ids, mask


@pytest.fixture(scope="module")
def reference(pair32, batch):
    """The loop without speculation."""
    return _sample(pair32[0], *batch, {"num_speculative_tokens": 0}, prompt_lookup_num_tokens=1)


PROPOSERS = {
    "draft chain, static": ({"policy": "static"}, True, {}),
    "draft chain, goodput": ({}, True, {}),
    "draft chain, no lookahead": ({"policy": "static", "draft_lookahead": 0}, True, {}),
    "draft tree": ({"policy": "static", "tree_node_budget": 6}, True, {}),
    "prompt lookup": ({"policy": "static"}, False, {"prompt_lookup_num_tokens": 3}),
    "lookup trie": ({"policy": "static", "tree_node_budget": 5}, False, {"prompt_lookup_num_tokens": 3}),
    "hybrid": ({"policy": "static", "proposer": "hybrid"}, True, {}),
    "no proposer named": ({}, False, {}),
}


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_samples_do_not_depend_on_the_proposer(pair32, batch, reference, name):
    target, draft = pair32
    config, uses_draft, kwargs = PROPOSERS[name]
    out = _sample(target, *batch, config, assistant_model=draft if uses_draft else None, **kwargs)
    assert torch.equal(out, reference)


def test_samples_do_not_depend_on_the_proposer_suffix(pair32, batch, reference):
    pytest.importorskip("arctic_inference.suffix_decoding", reason="the suffix extra")
    target, draft = pair32
    assert torch.equal(_sample(target, *batch, {"policy": "static", "proposer": "suffix"}), reference)
    out = _sample(target, *batch, {"policy": "static", "proposer": "suffix"}, assistant_model=draft)
    assert torch.equal(out, reference)


def test_samples_do_not_depend_on_the_batch(pair32, batch, reference):
    """Rows reordered, split over two calls (the group kept together), or beside other prompts: the same tokens."""
    target, draft = pair32
    ids, mask = batch
    width = ids.shape[1]
    order = torch.tensor([4, 0, 5, 2, 1, 3])
    shuffled = _sample(target, ids[order], mask[order], {"policy": "static"}, assistant_model=draft)
    assert torch.equal(shuffled[:, width:], reference[order, width:])
    for part in (torch.tensor([0, 2, 3]), torch.tensor([1, 4, 5])):
        alone = _sample(target, ids[part], mask[part], {"policy": "static"}, assistant_model=draft)
        assert torch.equal(alone[:, width:], reference[part, width:])
    other, other_mask = left_padded_prompts([4, 8], seed=9)
    other = torch.cat([torch.zeros((2, width - other.shape[1]), dtype=torch.long), other], dim=1)
    other_mask = torch.cat([torch.zeros((2, width - other_mask.shape[1]), dtype=torch.long), other_mask], dim=1)
    wider = _sample(target, torch.cat([other, ids]), torch.cat([other_mask, mask]), {"policy": "static"},
                    assistant_model=draft)
    assert torch.equal(wider[2:, width:], reference[:, width:])


def _sampled_one_by_one(model, ids, mask, seed: int, keying: str, max_new_tokens: int = 24) -> list[list[int]]:
    """Each row's coupled sample, drawn token by token from full forwards of the unpadded row, its keys computed on
    the host (`response_keys`): the definition the loop's device keys must meet."""
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    streams = stream_keys(prompts, seed)
    eos = model.generation_config.eos_token_id
    rows = []
    with torch.no_grad():
        for prompt, stream in zip(prompts, streams):
            response: list[int] = []
            while len(response) < max_new_tokens and (not response or response[-1] != eos):
                scores = model(torch.tensor([prompt + response])).logits[0, -1].float()  # [vocab]
                key = response_keys(prompt, response + [0], keying)[-1]
                response.append(int(coupled_choice(scores[None], stream[None], torch.tensor([key]))))
            rows.append(response)
    return rows


@pytest.mark.parametrize("keying", ["context", "position"])
def test_the_loop_samples_the_tokens_its_keys_define(pair32, batch, keying):
    """Through a draft tree (whose nodes' keys follow their paths), each row's tokens are those a token-by-token
    sampler draws with the host's keys."""
    target, draft = pair32
    ids, mask = batch
    out = _sample(target, ids, mask, {"policy": "static", "tree_node_budget": 6, "coupling_keys": keying},
                  assistant_model=draft)
    expected = _sampled_one_by_one(target, ids, mask, seed=3, keying=keying)
    for row, tokens in zip(out[:, ids.shape[1] :].tolist(), expected):
        assert row[: len(tokens)] == tokens


@pytest.mark.parametrize("tree", [0, 6])
def test_a_draft_equal_to_the_target_has_every_token_accepted(pair32, batch, tree):
    """The draft draws its perturbed argmax with the target's keys, along its own chain or tree paths."""
    target, _ = pair32
    out = _sample(target, *batch, {"policy": "static", "tree_node_budget": tree, "draft_lookahead": 0},
                  assistant_model=target, return_dict_in_generate=True)
    stats = out.dynspec_stats
    row_steps = stats.emitted_tokens - stats.accepted_tokens  # each row's verify emits what it accepted and one more
    assert stats.accepted_tokens >= 2 * row_steps
    if not tree:
        assert stats.accepted_tokens >= 0.95 * stats.draft_tokens


def test_a_new_seed_samples_anew(pair32, batch, reference):
    target, _ = pair32
    out = _sample(target, *batch, {"num_speculative_tokens": 0, "seed": 4}, prompt_lookup_num_tokens=1)
    assert not torch.equal(out, reference)


def test_group_indices_sample_different_rows(reference):
    assert not torch.equal(reference[0], reference[2])  # same prompt, indices 0 and 1


def test_standard_sampling_is_unchanged_by_default(pair32, batch):
    target, draft = pair32
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(hf_dynspec.generate(target, input_ids=batch[0], attention_mask=batch[1], do_sample=True,
                                        max_new_tokens=12, assistant_model=draft,
                                        dynspec_config=DynSpecConfig(policy="static")))
    assert torch.equal(runs[0], runs[1])


# ---- seeds -------------------------------------------------------------------------------------------------------------
def _unseeded(model, ids, mask, **config) -> torch.Tensor:
    settings = dict(do_sample=True, temperature=1.0, top_k=None, top_p=None, max_new_tokens=24)
    return hf_dynspec.generate(model, input_ids=ids, attention_mask=mask,
                               dynspec_config=DynSpecConfig(sampling="coupled", **config), **settings)


def test_calls_without_a_seed_sample_anew_and_a_seeded_run_repeats(pair32):
    target, _ = pair32
    ids, mask = left_padded_prompts([5, 7, 6], seed=4)
    first, second = _unseeded(target, ids, mask), _unseeded(target, ids, mask)
    assert not torch.equal(first, second)  # two calls: independent samples, not the same ones again
    torch.manual_seed(13)
    again = _unseeded(target, ids, mask)
    torch.manual_seed(13)
    assert torch.equal(_unseeded(target, ids, mask), again)  # `set_seed` reproduces a run
    assert torch.equal(_sample(target, ids, mask), _sample(target, ids, mask))  # an explicit seed: the same samples


def test_rollout_reuse_without_a_seed_uses_the_fixed_seed_and_says_so(pair32):
    target, _ = pair32
    ids, mask = left_padded_prompts([5, 7], seed=5)
    hf_dynspec.clear_rollouts(target)
    with pytest.warns(UserWarning, match=f"seed {REUSE_SEED}"):
        reused = _unseeded(target, ids, mask, reuse_rollouts=True, policy="static")
    hf_dynspec.clear_rollouts(target)
    seeded = _unseeded(target, ids, mask, reuse_rollouts=True, policy="static", seed=REUSE_SEED)
    hf_dynspec.clear_rollouts(target)
    assert torch.equal(reused, seeded)
    with pytest.raises(ValueError, match="seed"):
        DynSpecConfig(sampling="coupled", seed=-1)
