"""Verification: exact hand-built cases, seeded determinism, and convergence to the target distribution."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.verification import verify_greedy, verify_sampling


def one_hot(indices: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(indices), vocab).float()


# ---- hand-built cases ------------------------------------------------------------------------------------------------
def test_greedy_hand_built_with_placeholders():
    vocab = 5
    # target argmax per position: row 0 -> [1, 2, 3, 4]; row 1 -> [1, 0, 0, 0]; row 2 -> [2, 2, 2, 2]
    scores = torch.stack([one_hot([1, 2, 3, 4], vocab), one_hot([1, 0, 0, 0], vocab), one_hot([2, 2, 2, 2], vocab)])
    drafts = torch.tensor([[1, 2, 0], [1, 1, 1], [2, 2, 2]])
    lengths = torch.tensor([3, 3, 1])  # row 2 has one draft token; the rest are placeholders that must not count
    accepted, next_tokens = verify_greedy(scores, drafts, lengths)
    assert accepted.tolist() == [2, 1, 1]
    assert next_tokens.tolist() == [3, 0, 2]  # recovered, recovered, bonus


def test_sampling_hand_built_certain_outcomes():
    vocab = 4
    p = torch.stack([one_hot([2, 3, 1], vocab), one_hot([0, 0, 0], vocab)])  # [2, k + 1, vocab]
    q = torch.stack([one_hot([2, 3], vocab), one_hot([1, 1], vocab)])  # row 0 drafts what p wants; row 1 does not
    drafts = torch.tensor([[2, 3], [1, 1]])
    accepted, next_tokens = verify_sampling(p, drafts, torch.tensor([2, 2]), q)
    assert accepted.tolist() == [2, 0]
    assert next_tokens.tolist() == [1, 0]  # bonus from p[k]; recovered from norm(max(0, p - q)) = token 0


def test_sampling_deterministic_proposals_use_one_hot_q():
    p = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])
    drafts = torch.tensor([[0]])  # p(0) = 0: always rejected; residual is p itself without token 0
    for _ in range(20):
        accepted, next_tokens = verify_sampling(p, drafts, torch.tensor([1]), None)
        assert accepted.item() == 0 and next_tokens.item() in (1, 2)


# ---- convergence of the verifier alone ------------------------------------------------------------------------------
def total_variation(samples: torch.Tensor, reference: torch.Tensor) -> float:
    empirical = torch.bincount(samples, minlength=reference.shape[0]).float() / samples.shape[0]
    return 0.5 * float((empirical - reference).abs().sum())


def sampling_noise(target: torch.Tensor, n: int, quantile: float = 0.9999, repeats: int = 20_000) -> float:
    """The distance to `target` that exact sampling of `n` draws stays below with probability `quantile` (counts drawn
    as independent Poisson variables of mean `n * p`, each set normalised: the multinomial's law up to its total)."""
    generator = torch.Generator().manual_seed(1)
    rates = (target.double() * n).expand(repeats, -1)  # [repeats, outcomes]
    counts = torch.poisson(rates, generator=generator)
    empirical = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    distances = 0.5 * (empirical - target.double()).abs().sum(dim=1)  # [repeats]
    return float(torch.quantile(distances, quantile))


def assert_converges(draw, target: torch.Tensor, sizes=(100, 1_000, 10_000, 100_000)) -> None:
    """At every sample size the distance to the target is one that exact sampling of that size reaches (below its
    0.9999 quantile), it shrinks with the size, and it ends far below the distance to random references. (A ratio of
    the distances at two sizes would fail by chance: the smallest sample's distance is itself noise.)"""
    generator = torch.Generator().manual_seed(0)
    references = [torch.rand(target.shape[0], generator=generator) for _ in range(10)]
    references = [r / r.sum() for r in references]
    distances = [total_variation(draw(n), target) for n in sizes]
    limits = [sampling_noise(target, n) for n in sizes]
    assert all(d < limit for d, limit in zip(distances, limits, strict=True)), (distances, limits)
    assert distances[-1] < distances[0], distances
    final = draw(sizes[-1])
    assert total_variation(final, target) < 0.2 * min(total_variation(final, r) for r in references)


@pytest.mark.parametrize("k", [1, 3])
def test_verifier_output_follows_target(k):
    vocab = 6
    generator = torch.Generator().manual_seed(k)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=generator) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=generator) * 1.5, dim=-1)

    def first_and_second(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True) for i in range(k)], dim=1)  # [n, k]
        accepted, next_tokens = verify_sampling(
            p.expand(n, -1, -1), drafts, torch.full((n,), k), q.expand(n, -1, -1)
        )
        emitted = torch.cat([drafts, next_tokens.unsqueeze(1)], dim=1)
        emitted.scatter_(1, accepted.unsqueeze(1), next_tokens.unsqueeze(1))
        return emitted[:, 0], emitted[accepted >= 1, 1]

    assert_converges(lambda n: first_and_second(n)[0], p[0])
    assert_converges(lambda n: first_and_second(n)[1], p[1], sizes=(300, 3_000, 30_000, 300_000))


# ---- convergence of the whole loop -------------------------------------------------------------------------------
VOCAB, NEW = 6, 3


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = tiny_model("llama", seed=4, vocab=VOCAB, eos_token_id=None)
    target.generation_config.eos_token_id = None
    return target, perturbed(target, scale=0.3, seed=8)


def exact_joint(model, prompt: torch.Tensor, processors: LogitsProcessorList, new: int = NEW) -> torch.Tensor:
    """Probability of every continuation of `new` tokens under `model` with `processors`: `[VOCAB ** new]`."""
    joint = torch.ones(1)
    prefixes = prompt.unsqueeze(0)  # [1, length]
    for _ in range(new):
        logits = model(prefixes).logits[:, -1].float()
        probs = processors(prefixes, logits).softmax(dim=-1)  # [num_prefixes, vocab]
        joint = (joint.unsqueeze(1) * probs).reshape(-1)
        prefixes = torch.cat(
            [prefixes.repeat_interleave(VOCAB, dim=0), torch.arange(VOCAB).repeat(prefixes.shape[0]).unsqueeze(1)], 1
        )
    return joint


def sample_loop(
    target, draft, prompt, k, n, temperature, top_k, prefill_confidence=None, new=NEW, return_sequences=False
) -> torch.Tensor:
    """`[n]` codes of the `new` sampled tokens of `n` copies of `prompt` (base `VOCAB`, first token most significant):
    `n` rows of the batch, or with `return_sequences` one row and `num_return_sequences=n` (`hf_dynspec.generate`)."""
    copies = n if return_sequences else 1
    ids = prompt.unsqueeze(0).expand(n // copies, -1)
    run = functools.partial(hf_dynspec.generate, target) if return_sequences else target.generate
    out = run(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        num_return_sequences=copies,
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=None,
        max_new_tokens=new,
        assistant_model=draft,
        **({} if return_sequences else {"custom_generate": hf_dynspec.speculative_loop}),
        dynspec_config=DynSpecConfig(
            policy="static", num_speculative_tokens=k, prefill_draft_confidence=prefill_confidence
        ),
    )
    generated = out[:, prompt.shape[0] :]  # [n, new]
    return (generated * torch.tensor([VOCAB**i for i in reversed(range(new))])).sum(dim=1)


LOOP_NEW = 5
"""Tokens the loop test samples: the prefill's token, then up to 3 drafts and the target's token in one step (drafts
stop a token short of the end, so 3 new tokens would test drafts of at most 1 token)."""


def windows(codes: torch.Tensor, new: int = LOOP_NEW) -> dict[str, torch.Tensor]:
    """Codes of the first three and the last three of `new` tokens, from codes of all `new` (`[n]` each)."""
    return {"first": codes // VOCAB ** (new - NEW), "last": codes % VOCAB**NEW}


@pytest.mark.parametrize(
    ("k", "prefill_confidence", "return_sequences"),
    [
        (1, None, False),
        (3, None, False),
        (3, 0.5, False),  # the prefill verifies drafts ended by their own sampled probabilities
        (3, None, True),  # one prompt, `num_return_sequences=n`
    ],
)
@pytest.mark.slow
def test_loop_samples_follow_target_distribution(small_vocab_pair, k, prefill_confidence, return_sequences):
    target, draft = small_vocab_pair
    prompt = torch.tensor([3, 4, 5, 3, 2])
    temperature, top_k = 0.9, 5
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    with torch.no_grad():
        joint = exact_joint(target, prompt, processors, LOOP_NEW).reshape([VOCAB] * LOOP_NEW)
    laws = {"first": joint.sum(dim=(3, 4)).reshape(-1), "last": joint.sum(dim=(0, 1)).reshape(-1)}
    torch.manual_seed(k + (0 if prefill_confidence is None else 2) + (10 if return_sequences else 0))
    samples: dict[int, torch.Tensor] = {}  # draws per sample size, shared by both windows

    def draw(n: int) -> torch.Tensor:
        if n not in samples:
            samples[n] = sample_loop(target, draft, prompt, k, n, temperature, top_k, prefill_confidence, LOOP_NEW,
                                     return_sequences)
        return samples[n]

    for window, law in laws.items():
        assert_converges(lambda n, window=window: windows(draw(n))[window], law, sizes=(200, 2_000, 20_000))


def test_seeded_sampling_is_reproducible(small_vocab_pair):
    """With a policy whose lengths do not follow timings (not the default, `goodput`), the same seed gives the same
    samples."""
    target, draft = small_vocab_pair
    ids, mask = left_padded_prompts([4, 7, 5], vocab=VOCAB, seed=1)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(
            target.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                max_new_tokens=20,
                assistant_model=draft,
                custom_generate=hf_dynspec.speculative_loop,
                dynspec_config=DynSpecConfig(policy="static"),
            )
        )
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_sampled_output_scores_are_the_targets(small_vocab_pair):
    """With sampling, `output_logits` holds the target's logits before each sampled token and `output_scores` those
    logits after temperature and top-k, as in plain `generate`, whether the token was a draft's or the target's."""
    target, draft = small_vocab_pair
    ids, mask = left_padded_prompts([4, 7, 5], vocab=VOCAB, seed=1)
    torch.manual_seed(0)
    out = hf_dynspec.generate(
        target, input_ids=ids, attention_mask=mask, assistant_model=draft, do_sample=True, temperature=0.7, top_k=4,
        top_p=None, max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True,
        dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=3),
    )
    assert 0 < out.dynspec_stats.accepted_tokens < out.dynspec_stats.draft_tokens  # some drafts taken, some not
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1] :])], dim=1)
    with torch.no_grad():
        logits = target(out.sequences, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0))
    expected = logits.logits[:, ids.shape[1] - 1 : -1].float()  # [rows, new, vocab] before each new token
    torch.testing.assert_close(torch.stack(out.logits, dim=1), expected, rtol=1e-5, atol=1e-5)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(4)])
    warped = warpers(out.sequences, expected.reshape(-1, VOCAB)).reshape(expected.shape)
    torch.testing.assert_close(torch.stack(out.scores, dim=1), warped, rtol=1e-5, atol=1e-5)


def test_exact_joint_sums_to_one(small_vocab_pair):
    target, _ = small_vocab_pair
    with torch.no_grad():
        joint = exact_joint(target, torch.tensor([3, 4]), LogitsProcessorList([TemperatureLogitsWarper(0.9)]))
    assert joint.shape == (VOCAB**NEW,)
    assert abs(float(joint.sum()) - 1.0) < 1e-6
    assert sum(1 for _ in itertools.product(range(VOCAB), repeat=NEW)) == joint.shape[0]
