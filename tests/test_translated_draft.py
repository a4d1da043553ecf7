"""A draft with another tokenizer: its text is re-encoded for the target (transformers' universal assisted decoding),
row by row, inside the batched loop."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import BOS, EOS, PAD, SPECIAL_TOKENS, VOCAB, left_padded_prompts, perturbed, tiny_model, word_tokenizer
from test_sampling import VOCAB as SMALL_VOCAB
from test_sampling import assert_converges, exact_joint, small_vocab_pair  # noqa: F401 (fixture)
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.candidates.draft_model import MAX_INLINE_TAIL
from hf_dynspec.candidates.translated_draft import TranslatedDraftProposer
from hf_dynspec.policies import PolicyInput, PrefillFeedback, StaticPolicy, StepFeedback
from hf_dynspec.sequences import TokenBatch

SPECIALS = {"pad": PAD, "bos": BOS, "eos": EOS}


def shuffled_tokenizer(order: list[int], specials: dict[str, int] = SPECIALS) -> PreTrainedTokenizerFast:
    """The tiny models' word tokenizer with the words at other ids: word `w<i>` is id `order[i]` (special tokens keep
    their ids)."""
    words = {SPECIAL_TOKENS[role]: index for role, index in specials.items()}
    words |= {f"w{index}": order[index] for index in range(len(order)) if index not in specials.values()}
    backend = Tokenizer(WordLevel(words, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokens = {f"{role}_token": SPECIAL_TOKENS[role] for role in specials}
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **tokens)


def shuffled_copy(model, order: list[int]):
    """`model` with its vocabulary rows moved to the ids of `shuffled_tokenizer(order)`: the same model, in words."""
    copied = copy.deepcopy(model)
    index = torch.tensor(order)
    with torch.no_grad():
        for weight in (copied.get_input_embeddings().weight, copied.get_output_embeddings().weight):
            weight[index] = weight.clone()
    return copied


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0)
    order = list(range(VOCAB))
    movable = [i for i in range(VOCAB) if i not in SPECIALS.values()]
    shuffled = torch.tensor(movable)[torch.randperm(len(movable), generator=torch.Generator().manual_seed(1))]
    for source, destination in zip(movable, shuffled.tolist()):
        order[source] = destination
    assert order != list(range(VOCAB))
    return target, word_tokenizer(VOCAB), shuffled_tokenizer(order), order


@pytest.fixture(scope="module")
def prompts(pair):
    ids, mask = left_padded_prompts([4, 9, 6, 11, 3], seed=5)
    expected = pair[0].generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    return ids, mask, expected


def translated(target, draft, tokenizer, draft_tokenizer, ids, mask, **kwargs):
    kwargs.setdefault("dynspec_config", DynSpecConfig(policy="static", num_speculative_tokens=4))
    kwargs.setdefault("max_new_tokens", 24)
    return hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, assistant_model=draft,
                               tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer, return_dict_in_generate=True,
                               **kwargs)


def test_the_same_model_in_other_ids_drafts_what_the_target_decodes(pair, prompts):
    """Special tokens are dropped from the text the draft reads (as in transformers), so none may be generated here:
    then the draft sees every token the target sees, and agrees with it."""
    target, tokenizer, draft_tokenizer, order = pair
    ids, mask, _ = prompts
    words_only = dict(suppress_tokens=list(SPECIALS.values()), do_sample=False)
    expected = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, **words_only)
    out = translated(target, shuffled_copy(target, order), tokenizer, draft_tokenizer, ids, mask, **words_only)
    assert torch.equal(out.sequences, expected)
    stats = out.dynspec_stats
    assert stats.acceptance_rate == 1.0, stats.acceptance_rate  # it is the target, speaking other ids


@pytest.mark.parametrize("draft_kind", ["perturbed", "unrelated, smaller vocabulary"])
def test_translated_drafts_match_plain_greedy(pair, prompts, draft_kind):
    target, tokenizer, draft_tokenizer, order = pair
    ids, mask, expected = prompts
    if draft_kind == "perturbed":
        draft, words = perturbed(shuffled_copy(target, order), scale=0.05), draft_tokenizer
    else:
        # the target's words beyond the draft's become its unknown token (id 3): it writes only words the target knows
        draft = tiny_model("qwen2", seed=3, vocab=VOCAB - 20)
        words = word_tokenizer(VOCAB - 20, {**SPECIALS, "unk": 3})
    out = translated(target, draft, tokenizer, words, ids, mask, do_sample=False)
    assert torch.equal(out.sequences, expected)
    assert out.dynspec_stats.draft_tokens > 0


def test_translated_draft_with_the_default_policy(pair, prompts):
    target, tokenizer, draft_tokenizer, order = pair
    ids, mask, expected = prompts
    out = translated(target, shuffled_copy(target, order), tokenizer, draft_tokenizer, ids, mask, do_sample=False,
                     dynspec_config=DynSpecConfig())
    assert torch.equal(out.sequences, expected)


def test_translated_draft_proposes_the_same_under_sampling(pair):
    """When the target samples, the draft still drafts greedily (its likeliest tokens are the ones most often
    accepted against a one-hot `q`): two seeds, the same proposal, and no draft distribution."""
    target, tokenizer, draft_tokenizer, order = pair
    ids, mask = left_padded_prompts([6, 8, 3], seed=2)
    draft = perturbed(shuffled_copy(target, order), scale=0.3)
    config = GenerationConfig(do_sample=True, temperature=1.5, top_k=0, pad_token_id=PAD, eos_token_id=EOS)
    proposals = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        proposer = TranslatedDraftProposer(draft, tokenizer, draft_tokenizer, config, VOCAB)
        batch = TokenBatch(ids.clone(), ids.shape[1], mask.sum(dim=1), torch.zeros(3, dtype=torch.long), PAD,
                           max_new_tokens=16)
        proposer.start(batch)
        proposals.append(proposer.propose(batch, torch.tensor([5, 0, 3])))
        proposer.release()
    first, second = proposals
    assert first.probs is None
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.lengths, second.lengths)
    assert first.lengths.tolist()[1] == 0 and 0 < first.lengths[0] <= 5 and 0 < first.lengths[2] <= 3


def test_translated_draft_times_each_rows_catch_up_apart_and_reports_its_backlog(pair):
    """Rows draft one after another (`rows_apart`). A row's first draft forward reads its whole prompt: a catch-up,
    timed apart and announced beforehand as the row's backlog; the one-token forwards after it are the drafting
    forwards. A row that drafted has only the target's newest token left to read."""
    target, tokenizer, draft_tokenizer, order = pair
    ids, mask = left_padded_prompts([6, 8, 7], seed=2)
    draft = perturbed(shuffled_copy(target, order), scale=0.3)
    config = GenerationConfig(do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    proposer = TranslatedDraftProposer(draft, tokenizer, draft_tokenizer, config, VOCAB)
    assert proposer.rows_apart
    batch = TokenBatch(ids.clone(), ids.shape[1], mask.sum(dim=1), torch.zeros(3, dtype=torch.long), PAD,
                       max_new_tokens=16)
    proposer.start(batch)
    assert torch.equal(proposer.backlog(batch), batch.num_real)
    widths: list[int] = []
    counting = draft.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[-1]),
                                               with_kwargs=True)
    try:
        proposal = proposer.propose(batch, torch.tensor([5, 0, 4]))
        assert proposer.catchup_seconds > 0
        assert proposer.catchup_tokens == sum(w for w in widths if w > 2) > 0
        assert sorted(widths)[-2] > 2 and proposer.forwards == len(widths)  # two catch-ups among the forwards
        kept = torch.zeros(3, 1 + proposal.max_length, dtype=torch.bool)
        kept[:, :2] = True  # the root and each row's first draft token (none for row 1, which did not draft)
        proposer.commit(batch, proposal, kept)
        batch.num_generated += 2  # the step's emitted tokens: the accepted draft token and the target's own
        batch.host.num_generated += 2  # and the batch's copy on the host
        drafted = proposal.lengths > 0
        assert torch.equal(proposer.backlog(batch), torch.where(drafted, 1, batch.num_real))
        widths.clear()
        proposer.propose(batch, torch.tensor([3, 0, 0]))  # row 0 again: its draft's cache holds the row
        assert proposer.catchup_seconds == 0 and proposer.catchup_tokens == 0 and max(widths) <= 2
    finally:
        counting.remove()
        proposer.release()


class RecordingPolicy(StaticPolicy):
    """The static policy, keeping what the loop tells it."""

    def __init__(self) -> None:
        super().__init__(4)
        self.prefills: list[PrefillFeedback] = []
        self.requests: list[PolicyInput] = []
        self.steps: list[StepFeedback] = []

    def observe_prefill(self, feedback: PrefillFeedback) -> None:
        self.prefills.append(feedback)

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        self.requests.append(request)
        return super().draft_lengths(request)

    def observe(self, feedback: StepFeedback) -> None:
        self.steps.append(feedback)


def test_the_loop_tells_the_policy_how_a_translated_draft_costs(pair, prompts):
    """The policy hears that rows draft apart, sees each row's prompt as its backlog before the first draft, then a
    backlog within the inline tail on every step after one in which every row drafted; the first step's catch-up is
    reported apart from its drafting."""
    target, tokenizer, draft_tokenizer, order = pair
    ids, mask, expected = prompts
    policy = RecordingPolicy()
    out = translated(target, perturbed(shuffled_copy(target, order), scale=0.05), tokenizer, draft_tokenizer, ids,
                     mask, do_sample=False, dynspec_policy=policy, dynspec_config=DynSpecConfig(prefill_draft_confidence=None))
    assert torch.equal(out.sequences, expected)
    assert [feedback.draft_rows_apart for feedback in policy.prefills] == [True]
    first = policy.requests[0]
    assert bool((first.backlog > MAX_INLINE_TAIL).all())
    assert policy.steps[0].catchup_seconds > 0 and policy.steps[0].catchup_tokens > 0
    for before, request in zip(policy.steps, policy.requests[1:]):
        if bool((before.draft_lengths > 0).all()) and before.batch_size == request.batch_size:
            assert bool((request.backlog <= MAX_INLINE_TAIL).all()), request.backlog


@pytest.mark.slow
def test_translated_draft_samples_follow_target_distribution(small_vocab_pair):  # noqa: F811
    """Two sampled tokens per row: the prefill's, then one draft token accepted or rejected against a one-hot `q`."""
    target, draft = small_vocab_pair
    specials = {"pad": PAD, "bos": BOS}  # the small pair has no EOS
    order = [0, 1, 4, 5, 2, 3]
    words, draft_words = word_tokenizer(SMALL_VOCAB, specials), shuffled_tokenizer(order, specials)
    draft = shuffled_copy(draft, order)
    prompt = torch.tensor([3, 4, 5, 3, 2])
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(5)])
    with torch.no_grad():
        joint = exact_joint(target, prompt, processors, 2)

    def draw(n: int) -> torch.Tensor:
        ids = prompt.unsqueeze(0).expand(n, -1)
        out = hf_dynspec.generate(
            target, input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.9, top_k=5,
            top_p=None, max_new_tokens=2, assistant_model=draft, tokenizer=words, assistant_tokenizer=draft_words,
            dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=2),
        )
        generated = out[:, prompt.shape[0] :]  # [n, 2]
        return generated[:, 0] * SMALL_VOCAB + generated[:, 1]

    torch.manual_seed(0)
    assert_converges(draw, joint, sizes=(100, 1_000, 10_000))


def test_enabled_model_passes_both_tokenizers(pair, prompts):
    target, tokenizer, draft_tokenizer, order = pair
    ids, mask, expected = prompts
    enabled = hf_dynspec.enable(copy.deepcopy(target))
    out = enabled.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                           assistant_model=shuffled_copy(target, order), tokenizer=tokenizer,
                           assistant_tokenizer=draft_tokenizer, dynspec_config=DynSpecConfig(policy="static"),
                           return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.dynspec_stats.accepted_tokens > 0
