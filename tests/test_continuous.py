"""Speculation under transformers' continuous batching (`hf_dynspec.generate_batch`, `init_continuous_batching`):
greedy identity with `model.generate_batch` over many shapes, exact sampling, the manager's API (streaming,
cancellation, no blocks left behind) and clear errors."""

from __future__ import annotations

import math
import time

import pytest
import torch
from conftest import perturbed, tiny_model
from test_sampling import LOOP_NEW, VOCAB, assert_converges, exact_joint, small_vocab_pair, windows  # noqa: F401
from transformers import ContinuousBatchingConfig, GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper
from transformers.generation.continuous_batching.cache import PagedAttentionCache

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.candidates.free import ModelFreeSource, Offer
from hf_dynspec.candidates.prompt_lookup import LookupSource
from hf_dynspec.candidates.suffix import clear_suffix_caches
from hf_dynspec.continuous import (
    DraftRequest,
    HybridRequests,
    ModelFreeRequests,
    PagedDraftRequests,
    SpeculativeManager,
    Speculator,
    batch_processor,
    chain_and_alternatives,
)
from hf_dynspec.policies.static import StaticPolicy


def cb_config(page_size: int = 16, num_blocks: int = 64, max_batch_tokens: int = 256, **kwargs):
    """A small paged cache: its size does not depend on the machine's memory."""
    return ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, **kwargs
    )


def greedy(max_new_tokens: int, **kwargs) -> GenerationConfig:
    settings = {"eos_token_id": 1, "pad_token_id": 0} | kwargs
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, **settings)


def repetitive_prompts(lengths: list[int], seed: int, copies: int = 1) -> list[list[int]]:
    """Prompts over a small alphabet (so n-grams recur), each `copies` times in a row (TRL's layout)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [(torch.randint(0, 7, (n,), generator=generator) + 3).tolist() for n in lengths]
    return [prompt for prompt in prompts for _ in range(copies)]


def run(manager: SpeculativeManager, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> dict[str, list[int]]:
    """Every prompt through a started manager: request id -> generated tokens. Checks that no block is left."""
    ids = manager.add_requests(prompts, max_new_tokens=max_new_tokens, **kwargs)
    outputs = {}
    deadline = time.monotonic() + 120
    while len(outputs) < len(ids) and time.monotonic() < deadline:
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            assert result.error is None, result.error
            outputs[result.request_id] = result.generated_tokens
    assert len(outputs) == len(ids), "the manager did not finish every request"
    assert_no_blocks_held(manager)
    return {request_id: outputs[request_id] for request_id in ids}


def assert_no_blocks_held(manager) -> None:
    """No request holds a block of the paged cache, nor of a draft model's (finished and cancelled ones gave theirs
    back)."""
    caches = [manager.batch_processor.cache, getattr(manager.speculator.proposer, "cache", None)]
    for cache in [c for c in caches if isinstance(c, PagedAttentionCache)]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(a.block_table for a in cache.cache_allocators.values()):
            time.sleep(0.05)
        held = {name: list(a.block_table) for name, a in cache.cache_allocators.items() if a.block_table}
        assert not held, f"requests still hold blocks: {held}"


def speculating(model, *, generation_config, cb=None, **kwargs) -> SpeculativeManager:
    manager = hf_dynspec.init_continuous_batching(
        model, generation_config=generation_config, continuous_batching_config=cb or cb_config(), **kwargs
    )
    manager.start()
    return manager


CASES = [
    # family, proposer, policy, page size, step token budget, prompt lengths, copies, new tokens
    ("llama", "lookup", "static", 16, 256, [5, 9, 13, 7], 1, 80),
    ("llama", "lookup", "goodput", 16, 256, [5, 9, 13, 7], 1, 80),
    ("llama", "lookup", "static", 4, 256, [6, 11, 3], 2, 70),
    ("llama", "lookup", "static", 4, 12, [6, 11, 17, 3, 9], 1, 60),
    ("llama", "suffix", "static", 8, 256, [8, 12], 3, 36),
    ("llama", "suffix", "goodput", 8, 256, [8, 12], 3, 36),
    ("llama", "suffix", "static", 4, 10, [5, 9, 14], 2, 25),
    ("qwen2", "lookup", "static", 16, 256, [5, 9, 13, 7], 1, 80),
    ("qwen2", "lookup", "static", 4, 16, [10, 4, 8, 12], 2, 61),
    ("qwen2", "suffix", "static", 8, 256, [7, 10, 5], 2, 35),
    ("qwen2", "suffix", "goodput", 4, 20, [7, 10, 5], 3, 28),
    ("llama", "draft", "static", 16, 256, [5, 9, 13, 7], 1, 40),
    ("llama", "draft", "goodput", 8, 256, [5, 9, 13, 7], 1, 40),
    ("llama", "draft", "static", 4, 10, [6, 11, 17, 3, 9], 1, 30),
    ("qwen2", "draft", "static", 8, 20, [10, 4, 8, 12], 2, 33),
    ("llama", "suffix+draft", "static", 8, 20, [5, 9, 13, 7], 2, 40),
    ("llama", "suffix+draft", "goodput", 8, 256, [5, 9, 13, 7], 2, 40),
    ("qwen2", "hybrid", "static", 4, 16, [10, 4, 8, 12], 1, 45),
    ("llama", "default", "static", 4, 10, [6, 11, 17, 3, 9], 1, 30),
    ("qwen2", "default", "goodput", 8, 256, [5, 9, 13, 7], 2, 40),
]
"""The draft of `draft`, `suffix+draft`, `hybrid` and `default` cases is the target with noise on its weights
(`perturbed`, scale 0.1); the last three draft per request and step from suffix trees or prompt lookup, or from the
draft model. In the second pass of a `default` case a request's copy can reach past what the draft has seen."""
SOURCES = {"suffix": "suffix", "suffix+draft": "suffix", "hybrid": "hybrid", "draft": "draft"}
"""`DynSpecConfig.proposer` of each case's proposer (others: 'auto')."""


@pytest.mark.parametrize(("family", "proposer", "policy", "page", "budget", "lengths", "copies", "new"), CASES)
def test_greedy_matches_plain_generate_batch(family, proposer, policy, page, budget, lengths, copies, new):
    """Request by request, the tokens of plain `generate_batch`: small pages put draft tokens across block
    boundaries, small step budgets cut drafts (and a draft model's catch-up), repeated prompts share prefix blocks,
    and a second pass of the same prompts drafts from the first one's outputs (suffix trees)."""
    model = tiny_model(family, seed=0)
    prompts = repetitive_prompts(lengths, seed=len(lengths) + copies, copies=copies)
    config = greedy(new)
    expected = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config(page))
    expected = [output.generated_tokens for output in expected.values()]
    clear_suffix_caches(model)
    kwargs = {"prompt_lookup_num_tokens": 4} if proposer == "lookup" else {}
    if proposer in ("draft", "suffix+draft", "hybrid", "default"):
        kwargs = {"assistant_model": perturbed(model, scale=0.1, seed=3)}
    spec = DynSpecConfig(num_speculative_tokens=4, policy=policy, proposer=SOURCES.get(proposer, "auto"))
    manager = speculating(model, generation_config=config, cb=cb_config(page, max_batch_tokens=budget),
                          dynspec_config=spec, **kwargs)
    try:
        for attempt in range(2):
            got = list(run(manager, prompts, new).values())
            for row, (want, have) in enumerate(zip(expected, got)):
                assert have == want, f"pass {attempt}, request {row}"
    finally:
        manager.stop(block=True)
    stats = manager.speculation
    assert stats.emitted_tokens > 0
    if proposer != "draft" or policy == "static":  # goodput prices a tiny draft model by its timed forwards
        assert stats.draft_tokens > 0 and stats.accepted_tokens > 0, stats
    if proposer in ("suffix+draft", "hybrid") and policy == "static":  # both sources served requests
        assert 0 < stats.free_tokens < stats.draft_tokens, stats


TREE_CASES = [
    # family, proposer, policy, page size, step token budget, prompt lengths, copies, new tokens, tree nodes
    ("llama", "suffix", "static", 8, 256, [8, 12], 3, 36, 8),
    ("llama", "suffix", "goodput", 4, 256, [5, 9, 14], 4, 40, 10),
    ("qwen2", "suffix", "static", 4, 20, [7, 10, 5], 3, 28, 6),
    ("llama", "lookup", "static", 8, 256, [8, 12, 6], 1, 40, 8),
    ("qwen2", "lookup", "static", 4, 20, [7, 10, 5], 2, 30, 6),
    ("llama", "draft", "static", 8, 256, [8, 12, 6], 1, 36, 8),
    ("qwen2", "draft", "static", 4, 20, [7, 10, 5], 2, 30, 6),
    ("llama", "draft", "goodput", 4, 256, [5, 9, 14], 2, 32, 10),
    ("llama", "suffix+draft", "static", 8, 256, [8, 12], 3, 36, 8),
]
"""The draft of `draft` and `suffix+draft` cases is the target with noise on its weights (`perturbed`, scale 0.3, so
that its chains are often wrong and the alternatives get tried)."""


@pytest.mark.parametrize(
    ("family", "proposer", "policy", "page", "budget", "lengths", "copies", "new", "nodes"), TREE_CASES
)
def test_token_trees_match_plain_generate_batch(
    family, proposer, policy, page, budget, lengths, copies, new, nodes, monkeypatch
):
    """Suffix token trees (sibling requests make them branch), prompt-lookup tries and a draft model's chains with
    their alternatives give the tokens of plain `generate_batch`, with small pages and step budgets that cut trees,
    over two passes."""
    model = tiny_model(family, seed=0)
    prompts = repetitive_prompts(lengths, seed=len(lengths) + copies, copies=copies)
    config = greedy(new)
    expected = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config(page))
    clear_suffix_caches(model)
    kwargs = {"prompt_lookup_num_tokens": 4} if proposer == "lookup" else {}
    if "draft" in proposer:
        kwargs = {"assistant_model": perturbed(model, scale=0.3, seed=3)}
    moved = []
    copy = batch_processor._copy_positions
    monkeypatch.setattr(
        batch_processor, "_copy_positions", lambda cache, moves: moved.extend(moves) or copy(cache, moves)
    )
    spec = DynSpecConfig(num_speculative_tokens=4, policy=policy, proposer="suffix" if "suffix" in proposer else "auto",
                         tree_node_budget=nodes)
    manager = speculating(model, generation_config=config, cb=cb_config(page, max_batch_tokens=budget),
                          dynspec_config=spec, **kwargs)
    try:
        for attempt in range(2):
            got = list(run(manager, prompts, new).values())
            for row, (want, have) in enumerate(zip(expected.values(), got)):
                assert have == want.generated_tokens, f"pass {attempt}, request {row}"
    finally:
        manager.stop(block=True)
    if proposer != "draft" or policy == "static":  # goodput prices a tiny draft model by its timed forwards
        assert manager.speculation.accepted_tokens > 0, manager.speculation
    if "draft" in proposer and policy == "static":  # the target took the draft's alternatives (off its chain)
        assert moved, "no accepted node off the first branch"


def test_a_draft_tree_is_the_chain_and_its_most_valuable_alternatives():
    """`chain_and_alternatives`: the chain first (each node the child of the one before), then the other tokens of
    each depth as children of the chain's node above, the most valuable paths within the budget, parents first."""
    log = math.log
    depths = [([5, 6, 7], [log(0.6), log(0.3), log(0.1)]), ([8, 9, 2], [log(0.9), log(0.05), log(0.05)])]
    assert chain_and_alternatives(depths, 2, 0.0) == ([5, 8], [0, 1])
    # alternatives: 6 at depth 1 (0.3), 7 (0.1), then 9 and 2 below 5 (0.6 x 0.05 = 0.03 each)
    assert chain_and_alternatives(depths, 4, 0.0) == ([5, 8, 6, 7], [0, 1, 0, 0])
    assert chain_and_alternatives(depths, 9, 0.0) == ([5, 8, 6, 7, 9, 2], [0, 1, 0, 0, 1, 1])
    assert chain_and_alternatives(depths, 9, 0.2) == ([5, 8, 6], [0, 1, 0])  # paths below the floor stay out
    assert chain_and_alternatives([], 4, 0.0) == ([], [])


def test_a_draft_model_tree_costs_the_forwards_of_its_chain():
    """`PagedDraftRequests.trees`: its chain is the draft's chain (`drafts`), its other nodes the draft's runner-up
    tokens at each depth, and it runs as many draft forwards as the chain."""
    draft = tiny_model("llama", seed=4)
    prompts = repetitive_prompts([7, 11], seed=2)
    manager = speculating(tiny_model("llama", seed=0), assistant_model=draft, generation_config=greedy(8), cb=cb_config())
    manager.stop(block=True)
    proposer = PagedDraftRequests(draft, branching=3)
    proposer.open(manager)
    calls = []
    forward = proposer._packed_forward
    proposer._packed_forward = lambda feeds: calls.append(len(feeds)) or forward(feeds)
    requests = [DraftRequest(str(i), prompt, 4) for i, prompt in enumerate(prompts)]
    for i, prompt in enumerate(prompts):
        proposer.start(str(i), prompt)
    chains = proposer.drafts(requests, [3, 2])
    chain_forwards = len(calls)
    for i, prompt in enumerate(prompts):  # the same requests from scratch
        proposer.finish(str(i), None)
        proposer.start(str(i), prompt)
    trees = proposer.trees(requests, [3, 2], [7, 2])
    assert len(calls) == 2 * chain_forwards
    (tokens, parents), (short, short_parents) = trees
    assert tokens[:3] == chains[0] and parents[:3] == [0, 1, 2] and len(tokens) == 7
    assert all(p < 3 for p in parents[3:]) and len(set(zip(tokens[3:], parents[3:]))) == 4  # distinct leaves
    assert (short, short_parents) == (chains[1], [0, 1])  # a budget of its depth: the chain alone
    proposer.close()


def test_a_lookup_tree_holds_every_continuation_of_the_final_ngram():
    """Prompt lookup's trees per request: the continuations of both earlier occurrences of the request's last token, branching
    under the root, cut to the depth and node budget; parents before children (0: the newest token)."""
    lookup = ModelFreeRequests(LookupSource(max_ngram=2, min_ngram=1))
    request = DraftRequest("r", [5, 6, 7, 9, 5, 8, 7, 9, 3, 5], cap=4)
    assert lookup.trees([request], [2], [8]) == [([8, 7, 6, 7], [0, 1, 0, 3])]  # 5-8-7 (latest first), 5-6-7
    assert lookup.trees([request, request], [1, 0], [8, 8]) == [([8, 6], [0, 0]), ([], [])]
    tokens, parents = lookup.trees([request], [3], [3])[0]
    assert len(tokens) == 3 and all(parent <= node for node, parent in enumerate(parents))


class SecondBranchTrees(ModelFreeSource):
    """Token trees whose first branch is wrong and whose second is plain decoding's continuation (`outputs`, by
    prompt): every accepted node sits away from its path's position, so its keys and values must be moved."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.outputs, self.vocab = outputs, vocab

    def _continuation(self, tokens: torch.LongTensor) -> list[int]:
        for prompt, output in self.outputs.items():
            if tuple(tokens[: len(prompt)].tolist()) == prompt:
                return output[len(tokens) - len(prompt) :]
        raise AssertionError("unknown request")

    def offer(self, row: str, tokens: torch.LongTensor, max_tokens: int) -> Offer:
        return Offer(torch.tensor(self._continuation(tokens)[:max_tokens], dtype=torch.long), 1)

    def tree(self, row: str, tokens: torch.LongTensor, depth: int, budget: int) -> tuple[list[int], list[int]]:
        truth = self._continuation(tokens)[:depth]
        if not truth:
            return [], []
        wrong = [(truth[0] + 1 + j) % self.vocab for j in range(len(truth))]
        parents = list(range(len(truth))) + [0] + list(range(len(truth) + 1, 2 * len(truth)))
        return wrong + truth, parents


def test_an_accepted_second_branch_moves_its_keys_and_values():
    """Every step accepts its whole depth through a tree's second branch: the outputs stay those of plain decoding
    only if each node saw its ancestors alone, at its depth's position, and the accepted nodes' keys and values
    moved to their path's positions in the paged cache (across page boundaries: pages of 4)."""
    model = tiny_model("llama", seed=2)
    prompts = repetitive_prompts([6, 9, 13, 4], seed=5)
    config = greedy(30, eos_token_id=None)
    plain = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config(4))
    outputs = {tuple(p): o.generated_tokens for p, o in zip(prompts, plain.values())}
    proposer = ModelFreeRequests(SecondBranchTrees(outputs, model.config.vocab_size))
    speculator = Speculator(model, proposer, StaticPolicy(3), max_draft_tokens=3, max_tree_nodes=6)
    manager = SpeculativeManager(model, config, cb_config(4), speculator=speculator)
    manager.start()
    try:
        got = list(run(manager, prompts, 30).values())
    finally:
        manager.stop(block=True)
    assert got == list(outputs.values())
    stats = manager.speculation
    assert stats.accepted_tokens > 10 and 2 * stats.accepted_tokens == stats.draft_tokens, stats  # half the nodes


def test_generate_batch_matches_plain_and_leaves_no_manager_behind():
    model = tiny_model("llama", seed=1)
    prompts = repetitive_prompts([6, 10, 4], seed=3)
    config = greedy(24)
    expected = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config())
    got = hf_dynspec.generate_batch(
        model, prompts, prompt_lookup_num_tokens=3, generation_config=config, continuous_batching_config=cb_config(),
    )
    assert list(got) == list(expected)
    assert [o.generated_tokens for o in got.values()] == [o.generated_tokens for o in expected.values()]
    assert getattr(model, "_cached_continuous_batching_manager", None) is None
    again = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config())
    assert [o.generated_tokens for o in again.values()] == [o.generated_tokens for o in expected.values()]


def test_logprobs_and_timestamps_cover_every_emitted_token():
    model = tiny_model("llama", seed=1)
    prompts = repetitive_prompts([6, 9], seed=5, copies=2)
    config = greedy(30)
    plain = model.generate_batch(prompts, generation_config=config,
                                 continuous_batching_config=cb_config(return_logprobs=True), record_timestamps=True)
    spec = hf_dynspec.generate_batch(
        model, prompts, prompt_lookup_num_tokens=4, dynspec_config={"policy": "static"}, generation_config=config,
        continuous_batching_config=cb_config(return_logprobs=True), record_timestamps=True,
    )
    for want, have in zip(plain.values(), spec.values()):
        assert have.generated_tokens == want.generated_tokens
        assert len(have.logprobs) == len(have.generated_tokens) == len(have.timestamps)
        torch.testing.assert_close(torch.tensor(have.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=1e-4)


def test_streaming_outputs_grow_to_the_final_one():
    model = tiny_model("llama", seed=1)
    prompt = repetitive_prompts([9], seed=2)[0]
    config = greedy(30)
    expected = model.generate_batch([prompt], generation_config=config, continuous_batching_config=cb_config())
    manager = speculating(model, generation_config=config, prompt_lookup_num_tokens=4,
                          dynspec_config={"policy": "static"})
    try:
        request_id = manager.add_request(prompt, max_new_tokens=30, streaming=True)
        seen = [list(output.generated_tokens) for output in manager.request_id_iter(request_id)]
    finally:
        manager.stop(block=True)
    assert seen[-1] == next(iter(expected.values())).generated_tokens
    assert all(later[: len(earlier)] == earlier for earlier, later in zip(seen, seen[1:]))
    assert len(seen) < len(seen[-1]), "no step emitted more than one token"


def test_a_cancelled_request_leaves_no_blocks_and_others_finish():
    model = tiny_model("llama", seed=1)
    prompts = repetitive_prompts([7, 11], seed=4)
    config = greedy(200, eos_token_id=-1)  # no EOS: the long request runs until cancelled
    manager = speculating(model, generation_config=config, cb=cb_config(page_size=4), prompt_lookup_num_tokens=4,
                          dynspec_config={"policy": "static"})
    try:
        long_id = manager.add_request(prompts[0], max_new_tokens=200, streaming=True)
        first = next(manager.request_id_iter(long_id))
        assert not first.is_finished()
        manager.cancel_request(long_id)
        finished = run(manager, [prompts[1]], 20)
        assert len(next(iter(finished.values()))) == 20
        assert_no_blocks_held(manager)
        assert long_id not in manager.speculator._known
    finally:
        manager.stop(block=True)


def test_a_draft_model_equal_to_the_target_has_every_draft_token_accepted():
    """The draft's own paged cache holds what the target's does: prompts caught up in chunks of the step budget,
    accepted tokens fed, rejected positions rewritten. A draft equal to the target (eager attention, made paged for
    the run and restored after) then proposes exactly the target's tokens."""
    model = tiny_model("qwen2", seed=2)
    draft = perturbed(model, scale=0.0)
    draft.set_attn_implementation("eager")
    prompts = repetitive_prompts([23, 5, 14], seed=6, copies=2)
    config = greedy(26, eos_token_id=-1)
    expected = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config(4))
    manager = speculating(model, generation_config=config, cb=cb_config(4, max_batch_tokens=12),
                          assistant_model=draft, dynspec_config={"policy": "static", "num_speculative_tokens": 3})
    try:
        got = run(manager, prompts, 26)
        assert draft.config._attn_implementation == "paged|eager"
    finally:
        manager.stop(block=True)
    assert list(got.values()) == [o.generated_tokens for o in expected.values()]
    stats = manager.speculation
    assert stats.draft_tokens > len(prompts) * 10 and stats.accepted_tokens == stats.draft_tokens, stats
    assert draft.config._attn_implementation == "eager"


def test_caches_sized_by_memory_share_the_budget_between_target_and_draft(monkeypatch):
    """Without `num_blocks` (as `transformers serve` runs) the paged caches are sized by memory: the target's takes
    its share of `max_memory_percent` (half, for a draft no wider per token), so the draft's, holding as many tokens,
    fits in the rest. Sized alone, the target's took the whole budget and the draft's raised a MemoryError. The
    machine's memory is replaced by the process's use plus 64 MiB."""
    import psutil
    from transformers.generation.continuous_batching import cache as paged

    model = tiny_model("llama", seed=2)
    total = psutil.Process().memory_info().rss + 64 * 2**20

    def breakdown() -> tuple[torch.device, int, int, int]:
        used = psutil.Process().memory_info().rss
        return torch.device("cpu"), total, used, used

    monkeypatch.setattr(paged, "get_device_and_memory_breakdown", breakdown)
    cb = ContinuousBatchingConfig(page_size=16, max_batch_tokens=64, max_memory_percent=0.6)
    manager = hf_dynspec.init_continuous_batching(
        model, perturbed(model, scale=0.0), generation_config=greedy(8), continuous_batching_config=cb,
        dynspec_config={"policy": "static", "num_speculative_tokens": 2},
    )
    manager.warmup()
    target_cache, draft_cache = manager.batch_processor.cache, manager.speculator.proposer.cache
    assert draft_cache is not None and draft_cache.num_blocks >= target_cache.num_blocks > 0
    assert manager.continuous_batching_config.max_memory_percent == 0.6


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["lookup", "suffix", "suffix-tree", "draft", "draft-tree", "suffix+draft"])
def test_samples_follow_target_distribution(small_vocab_pair, proposer):  # noqa: F811
    """Sampled requests (temperature) speculate and follow the target's joint law of their tokens (suffix trees:
    through multi-draft rejection sampling)."""
    target, draft = small_vocab_pair
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    temperature = 0.9
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    with torch.no_grad():
        joint = exact_joint(target, torch.tensor(prompt), processors, LOOP_NEW).reshape([VOCAB] * LOOP_NEW)
    laws = {"first": joint.sum(dim=(3, 4)).reshape(-1), "last": joint.sum(dim=(0, 1)).reshape(-1)}
    config = GenerationConfig(max_new_tokens=LOOP_NEW, do_sample=True, temperature=temperature, top_k=None,
                              top_p=None, eos_token_id=None, pad_token_id=0)
    kwargs = {"lookup": {"prompt_lookup_num_tokens": 3}}.get(proposer, {})
    kwargs = {"assistant_model": draft} if "draft" in proposer else kwargs
    source = "auto" if proposer in ("lookup", "draft", "draft-tree") else "suffix"
    spec = DynSpecConfig(num_speculative_tokens=3, policy="static", proposer=source,
                         suffix_min_token_probability=0.0, tree_node_budget=6 if proposer.endswith("tree") else 0)
    cb = cb_config(page_size=16, num_blocks=512, max_batch_tokens=2048, max_requests_per_batch=256)
    manager = speculating(target, generation_config=config, cb=cb, dynspec_config=spec, **kwargs)
    samples: dict[int, torch.Tensor] = {}
    powers = torch.tensor([VOCAB**i for i in reversed(range(LOOP_NEW))])

    def draw(n: int) -> torch.Tensor:
        if n not in samples:
            outputs = run(manager, [prompt] * n, LOOP_NEW)
            samples[n] = (torch.tensor(list(outputs.values())) * powers).sum(dim=1)
        return samples[n]

    torch.manual_seed(0)
    try:
        for window, law in laws.items():
            assert_converges(lambda n, window=window: windows(draw(n))[window], law, sizes=(100, 1_000, 6_000))
    finally:
        manager.stop(block=True)
    stats = manager.speculation
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0
    if proposer == "suffix+draft":  # both sources served requests
        assert 0 < stats.free_tokens < stats.draft_tokens, stats


def test_requests_that_cannot_speculate_get_clear_errors():
    model = tiny_model("llama", seed=1)
    config = greedy(8)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=N"):
        hf_dynspec.init_continuous_batching(model, generation_config=config)
    with pytest.raises(ValueError, match="a draft model takes no `prompt_lookup_num_tokens`"):
        hf_dynspec.init_continuous_batching(model, tiny_model("llama", seed=2), prompt_lookup_num_tokens=2,
                                            generation_config=config)
    with pytest.raises(ValueError, match="vocabulary"):
        hf_dynspec.init_continuous_batching(model, tiny_model("llama", seed=2, vocab=40), generation_config=config)
    flex = tiny_model("llama", seed=2)
    flex.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="cannot read a paged cache"):
        hf_dynspec.init_continuous_batching(model, flex, generation_config=config)
    with pytest.raises(ValueError, match="needs a draft model"):
        hf_dynspec.init_continuous_batching(model, generation_config=config, dynspec_config={"proposer": "hybrid"})
    with pytest.raises(ValueError, match="proposer='draft'.*needs a draft model"):
        hf_dynspec.init_continuous_batching(model, generation_config=config, dynspec_config={"proposer": "draft"})
    with pytest.raises(ValueError, match="positive integer"):
        hf_dynspec.init_continuous_batching(model, prompt_lookup_num_tokens=0, generation_config=config)
    flash = tiny_model("llama", seed=2)
    flash.config._attn_implementation = "paged|flash_attention_2"
    with pytest.raises(ValueError, match="takes a mask"):
        hf_dynspec.init_continuous_batching(flash, generation_config=config,
                                            dynspec_config={"tree_node_budget": 4, "proposer": "suffix"})
    with pytest.raises(ValueError, match="drop `prompt_lookup_num_tokens`"):
        hf_dynspec.init_continuous_batching(model, prompt_lookup_num_tokens=2, generation_config=config,
                                            dynspec_config={"proposer": "suffix"})
    with pytest.raises(ValueError, match="beam search"):
        hf_dynspec.init_continuous_batching(model, prompt_lookup_num_tokens=2,
                                            generation_config=greedy(8, num_beams=2))
    with pytest.raises(ValueError, match="use_async_batching=False"):
        hf_dynspec.init_continuous_batching(model, prompt_lookup_num_tokens=2, generation_config=config,
                                            continuous_batching_config=cb_config(use_async_batching=True))
    sliding = tiny_model("qwen2", seed=1, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window layers"):
        hf_dynspec.init_continuous_batching(sliding, prompt_lookup_num_tokens=2, generation_config=config)
    with pytest.raises(ValueError, match="sliding-window layers"):
        hf_dynspec.init_continuous_batching(tiny_model("qwen2", seed=1), sliding, generation_config=config)


def test_an_enabled_model_speculates_in_its_own_generate_batch():
    """`enable` with a suffix config makes `model.generate_batch` (TRL's continuous-batching rollouts, `transformers
    serve`) speculate; without a model-free proposer, and after `disable`, transformers' manager runs."""
    model = tiny_model("llama", seed=0)
    prompts = repetitive_prompts([8, 12], seed=3, copies=2)
    config = greedy(30)
    expected = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config())
    hf_dynspec.enable(model, dynspec_config=DynSpecConfig(proposer="suffix", policy="static"))
    try:
        for _ in range(2):  # the second call drafts from the first one's outputs
            got = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config(),
                                       persistent_manager=True)
            assert [o.generated_tokens for o in got.values()] == [o.generated_tokens for o in expected.values()]
        manager = model._cached_continuous_batching_manager
        assert isinstance(manager, SpeculativeManager) and manager.speculation.accepted_tokens > 0
        model.destroy_cached_continuous_batching_manager()
    finally:
        hf_dynspec.disable(model)
    plain = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config())
    assert not isinstance(plain, SpeculativeManager)



def test_a_bound_draft_speculates_in_the_models_own_generate_batch():
    """`enable(model, draft)` makes `model.generate_batch` draft with it, in the draft's own paged cache."""
    model = tiny_model("llama", seed=0)
    prompts = repetitive_prompts([8, 12, 5], seed=9)
    config = greedy(24)
    expected = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config())
    hf_dynspec.enable(model, perturbed(model, scale=0.05, seed=5), dynspec_config={"policy": "static"})
    try:
        got = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config(),
                                   persistent_manager=True)
        manager = model._cached_continuous_batching_manager
        proposer = manager.speculator.proposer  # by default, copies from the context beside the draft model
        assert isinstance(proposer, HybridRequests) and isinstance(proposer.draft, PagedDraftRequests)
        assert manager.speculation.accepted_tokens > 0
        model.destroy_cached_continuous_batching_manager()
    finally:
        hf_dynspec.disable(model)
    assert [o.generated_tokens for o in got.values()] == [o.generated_tokens for o in expected.values()]


def test_suffix_hints_say_how_sure_each_offer_is():
    """The policy sees each request's suffix offer, its match length and how sure it is, as in `generate`."""
    from hf_dynspec.candidates.suffix import SuffixCache, SuffixSettings, SuffixSource

    cache = SuffixCache(SuffixSettings(min_token_probability=0.0, max_spec_factor=4.0))
    for ending in ([14, 16], [14, 16], [15, 18]):
        request = cache.start([])
        cache.extend(request, [11, 12, 13, *ending])
        cache.stop(request)
    proposer = ModelFreeRequests(SuffixSource(cache))
    proposer.start("a", [20, 11, 12, 13])
    hints = proposer.hints([DraftRequest("a", [20, 11, 12, 13], 2)])
    assert hints["free_lengths"].tolist() == [2] and hints["free_anchors"].tolist() == [3]
    assert hints["free_confidence"].tolist() == pytest.approx([(2 / 3) ** 0.5])
    assert proposer.drafts([DraftRequest("a", [20, 11, 12, 13], 2)], [1]) == [[14]]
    proposer.finish("a", None)
    assert "free_confidence" not in ModelFreeRequests(LookupSource(3, 1)).hints([DraftRequest("b", [5, 6, 5], 2)])
