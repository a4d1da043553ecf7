"""Greedy disagreements between a draft and its target: the fewest verifies any greedy chain method needs."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import perturbed, tiny_model

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.candidates.prompt_lookup import lookup_continuation
from hf_dynspec.evaluation.headroom import (
    Disagreements,
    GreedyTrace,
    OracleCosts,
    copy_matches,
    fastest_schedule,
    greedy_disagreements,
    greedy_traces,
    head_chains,
    headroom_table,
    static_schedule,
)

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8, 41, 17, 60, 2], [11, 4]]


def brute_force(target, draft, prompt: list[int], new_tokens: int) -> tuple[int, int, int]:
    """Decode with the target one token at a time and ask the draft at every prefix."""
    tokens, disagreements, second_right = list(prompt), 0, 0
    with torch.no_grad():
        for position in range(new_tokens):
            ids = torch.tensor([tokens])
            token = int(target(ids).logits[0, -1].argmax())
            first, second = draft(ids).logits[0, -1].topk(2).indices.tolist()
            if 0 < position < new_tokens - 1 and first != token:  # positions a chain drafts
                disagreements += 1
                second_right += int(second == token)
            tokens.append(token)
    return new_tokens, disagreements, second_right


@pytest.mark.parametrize("scale", [0.0, 0.05, 0.3])
def test_disagreements_match_a_token_by_token_count(scale):
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None  # every prompt decodes its 12 tokens
    draft = perturbed(target, scale) if scale else target
    counts = greedy_disagreements(target, draft, PROMPTS, max_new_tokens=12, progress=False)
    found = [(c.new_tokens, c.disagreements, c.second_right) for c in counts]
    assert found == [brute_force(target, draft, p, 12) for p in PROMPTS]
    if scale == 0.0:
        assert all(c.disagreements == 0 and c.fewest_verifies == 1 for c in counts)
    if scale == 0.3:
        assert sum(c.disagreements for c in counts) > 0  # the test can tell a draft that disagrees


def test_no_chain_verifies_fewer_times_than_the_disagreements_allow():
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    draft = perturbed(target, 0.1)
    counts = greedy_disagreements(target, draft, PROMPTS, max_new_tokens=16, progress=False)
    for prompt, count in zip(PROMPTS, counts):
        ids = torch.tensor([prompt])
        out = target.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
            assistant_model=draft, custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True,
            dynspec_config=DynSpecConfig(num_speculative_tokens=15, policy="static", draft_lookahead=0),
        )
        verifies = out.dynspec_stats.num_steps
        assert verifies >= count.fewest_verifies
        assert verifies == count.fewest_verifies  # drafting to the end, a chain verifies exactly at the disagreements


@pytest.mark.parametrize(("prompts", "new", "message"), [(PROMPTS, 0, "max_new_tokens"), ([[4, 5], []], 4, "one token")])
def test_bad_input_is_refused(prompts, new, message):
    target = tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match=message):
        greedy_disagreements(target, target, prompts, max_new_tokens=new, progress=False)


# ---- oracle schedules ----------------------------------------------------------------------------------------------
def flat_costs(draft_forward: float = 0.1, lookahead: int = 0, max_draft: int = 32, max_lookup: int = 32) -> OracleCosts:
    return OracleCosts(lambda width: 1.0 + 0.05 * (width - 1), draft_forward, lookahead, max_draft, max_lookup)


def exhaustive(trace: GreedyTrace, costs: OracleCosts, lookup: bool, n: int = 1) -> float:
    """Every schedule from position `n`, tried one by one (tiny traces only)."""
    size = len(trace.new)
    if n >= size:
        return 0.0
    room, tokens = size - n - 1, trace.prompt + trace.new
    options = [costs.verify(1) + exhaustive(trace, costs, lookup, n + 1)]
    for k in range(1, room + 1):
        if not all(trace.agrees[n : n + k]) or k > costs.max_draft:
            break
        forwards, position = 0, n
        while position < n + k:  # each forward yields its token and the lookahead guesses that hold
            forwards += 1
            guess = lookup_continuation(torch.tensor(tokens[: len(trace.prompt) + position]), 3, 1, costs.lookahead)
            held = 0
            for offset, token in enumerate(guess.tolist()):
                if len(trace.prompt) + position + offset >= len(tokens) or token != tokens[len(trace.prompt) + position + offset]:
                    break
                held += 1
            position += 1 + held
        options.append(forwards * costs.draft_forward + costs.verify(k + 1) + exhaustive(trace, costs, lookup, n + k + 1))
    if lookup:
        guess = lookup_continuation(torch.tensor(tokens[: len(trace.prompt) + n]), 3, 1, costs.max_lookup).tolist()
        for j in range(1, min(len(guess), room) + 1):
            if guess[:j] != trace.new[n : n + j]:
                break
            options.append(costs.verify(j + 1) + exhaustive(trace, costs, lookup, n + j + 1))
    return min(options)


def random_trace(seed: int, size: int) -> GreedyTrace:
    rng = random.Random(seed)
    prompt = [rng.randrange(6) for _ in range(rng.randrange(2, 9))]
    new = [rng.randrange(6) for _ in range(size)]
    agrees = [rng.random() < 0.7 for _ in range(size)]
    return GreedyTrace(prompt, new, agrees, [False] * size)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("lookup", [False, True])
def test_oracle_schedule_is_the_fastest_of_every_schedule(seed, lookup):
    trace = random_trace(seed, size=9)
    costs = flat_costs(draft_forward=0.15, lookahead=seed % 3, max_draft=5, max_lookup=4)
    assert fastest_schedule(trace, costs, lookup).seconds == pytest.approx(exhaustive(trace, costs, lookup))


def test_oracle_drafts_through_agreement_and_copies_with_lookup():
    prompt = [7, 1, 2, 3, 4, 5, 6, 8, 9]
    agreeing = GreedyTrace(prompt, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [True] * 10, [False] * 10)
    schedule = fastest_schedule(agreeing, flat_costs(), lookup=True)
    assert (schedule.verifies, schedule.draft_forwards, schedule.lookup_steps) == (1, 8, 0)  # nothing to look up
    assert schedule.seconds == pytest.approx(8 * 0.1 + 1.0 + 0.05 * 8)
    copying = GreedyTrace(prompt, [7, 1, 2, 3, 4, 5, 6, 8, 9], [False] * 9, [False] * 9)  # the prompt again
    alone = fastest_schedule(copying, flat_costs(), lookup=False)
    assert (alone.verifies, alone.draft_forwards) == (8, 0)  # a draft that never agrees: plain decoding
    looked_up = fastest_schedule(copying, flat_costs(), lookup=True)
    assert (looked_up.verifies, looked_up.draft_forwards, looked_up.lookup_steps) == (1, 0, 1)


def test_lookahead_saves_draft_forwards_where_lookup_guesses_right():
    prompt = [7, 1, 2, 3, 4, 5, 6, 8, 9]
    copying = GreedyTrace(prompt, [7, 1, 2, 3, 4, 5, 6, 8, 9], [True] * 9, [False] * 9)
    without = fastest_schedule(copying, flat_costs(lookahead=0), lookup=False)
    with_lookahead = fastest_schedule(copying, flat_costs(lookahead=3), lookup=False)
    assert (without.verifies, without.draft_forwards) == (1, 7)
    assert (with_lookahead.verifies, with_lookahead.draft_forwards) == (1, 2)  # 4 tokens a forward, 7 to draft


def test_free_drafts_verify_exactly_at_the_disagreements():
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    traces = greedy_traces(target, perturbed(target, 0.1), PROMPTS, max_new_tokens=16, progress=False)
    free = OracleCosts(lambda width: 1.0, 0.0, 0, 32, 32)
    for trace in traces:
        assert fastest_schedule(trace, free, lookup=False).verifies == Disagreements.of(trace).fewest_verifies


def test_trees_follow_the_draft_s_runner_up_at_the_price_of_its_sibling():
    prompt = [7, 1, 2]
    ranks = [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]  # the target's fourth token is the draft's second choice
    trace = GreedyTrace(prompt, list(range(20, 30)), [r == 0 for r in ranks], [r == 1 for r in ranks], ranks)
    costs = flat_costs(draft_forward=0.1)
    chain = fastest_schedule(trace, costs)
    assert (chain.verifies, chain.draft_forwards) == (2, 7)  # 2 agreeing tokens, then 5 more after the disagreement
    tree = fastest_schedule(trace, costs, branching=2)
    assert (tree.verifies, tree.draft_forwards) == (1, 8)
    assert tree.seconds == pytest.approx(8 * 0.1 + 1.0 + 0.05 * 9)  # 8 deep, 9 nodes: the path and one sibling
    assert fastest_schedule(trace, costs, branching=2, max_nodes=8).verifies == 2  # 9 nodes are over the budget
    with pytest.raises(ValueError, match="without draft ranks"):
        fastest_schedule(GreedyTrace(prompt, trace.new, trace.agrees, trace.second), costs, branching=2)


# ---- suffix trees with hindsight -----------------------------------------------------------------------------------
def copies_by_every_match_length(
    trace: GreedyTrace, max_tokens: int, earlier: list[list[int]], max_depth: int, spec_factor: float
) -> list[int]:
    """`copy_matches` the long way: every match length, every place the text's last tokens occur."""
    tokens, start, out = trace.prompt + trace.new, len(trace.prompt), []
    for n in range(len(trace.new)):
        end, best = start + n, 0
        truth = tokens[end : end + max_tokens]
        for source in [tokens[:end], *earlier]:
            for m in range(1, min(max_depth, end) + 1):
                for q in range(m, len(source)):  # `source[q - m : q]` is the match, `source[q]` what followed it
                    if source[q - m : q] != tokens[end - m : end]:
                        continue
                    right = 0
                    while right < len(truth) and q + right < len(source) and source[q + right] == truth[right]:
                        right += 1
                    best = max(best, min(right, int(spec_factor * m)))
        out.append(best)
    return out + [0]


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("spec_factor", [0.5, 1.0, 2.0])
def test_copy_matches_is_the_best_continuation_of_every_match(seed, spec_factor):
    rng = random.Random(seed)
    trace = random_trace(seed, size=rng.randrange(1, 14))
    earlier = [[rng.randrange(6) for _ in range(rng.randrange(0, 12))] for _ in range(rng.randrange(0, 3))]
    max_tokens, depth = rng.randrange(1, 6), rng.randrange(1, 5)
    expected = copies_by_every_match_length(trace, max_tokens, earlier, depth, spec_factor)
    assert copy_matches(trace, max_tokens, earlier, depth, spec_factor) == expected


def right_along_paths(token_ids: list[int], parents: list[int], truth: list[int]) -> int:
    """The most of `truth` a draft tree (`parents[i]`: node `i`'s parent, -1 under the root) holds as one path."""
    depths: dict[int, int] = {}  # node -> its depth, for nodes whose whole path is right
    for node, (token, parent) in enumerate(zip(token_ids, parents)):
        depth = 1 if parent < 0 else depths.get(parent, -1) + 1
        if depth >= 1 and depth <= len(truth) and token == truth[depth - 1]:
            depths[node] = depth
    return max(depths.values(), default=0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tree", [False, True])
def test_copy_matches_bounds_what_arctic_inference_s_suffix_trees_propose_right(seed, tree):
    """The bound holds for the trees `proposer="suffix"` drafts from: the row's own text and a cache of earlier
    outputs, chains and token trees, at the proposer's settings."""
    from hf_dynspec.candidates.suffix import SuffixCache, SuffixSettings

    rng = random.Random(seed)
    settings = SuffixSettings(max_depth=6, min_token_probability=0.0)
    trace = random_trace(seed, size=40)
    trace.new = [rng.choice([1, 2, 3]) if rng.random() < 0.6 else t for t in trace.new]  # repetitive, so it matches
    earlier = [trace.new[5:25], [rng.randrange(6) for _ in range(30)]]
    cache = SuffixCache(settings)
    for text in earlier:
        request = cache.start([0])
        cache.extend(request, text)
        cache.stop(request)
    bound = copy_matches(trace, 8, earlier, settings.max_depth, settings.max_spec_factor)
    request, proposed_right = cache.start(trace.prompt), 0
    for n, token in enumerate(trace.new):
        draft = cache.speculate(request, trace.prompt + trace.new[:n], 8, tree)
        right = right_along_paths(list(draft.token_ids), list(draft.parents), trace.new[n : n + 8])
        assert right <= bound[n], (n, right, bound[n])
        proposed_right += right
        cache.extend(request, [token])
    assert proposed_right > 0  # the cache held what came next, so the check is not vacuous


def test_the_oracle_copies_an_earlier_output_through_suffix_trees():
    prompt, sibling = [7, 1, 2], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    trace = GreedyTrace(prompt, [9, *sibling], [False] * 11, [False] * 11)  # writes what a sibling wrote
    alone = fastest_schedule(trace, flat_costs(), free=copy_matches(trace, 32))
    assert (alone.verifies, alone.lookup_steps) == (10, 0)  # nothing in its own text to copy
    at_once = copy_matches(trace, 32, earlier=[[9, *sibling]], spec_factor=16.0)
    assert (fastest_schedule(trace, flat_costs(), free=at_once).verifies, at_once[1]) == (1, 10)
    growing = copy_matches(trace, 32, earlier=[[9, *sibling]])  # a token per matched token
    assert growing[1:4] == [1, 2, 3]
    assert fastest_schedule(trace, flat_costs(), free=growing).verifies == 3  # copies 1, 3 and the last 3 tokens
    with pytest.raises(ValueError, match="one count per new token"):
        fastest_schedule(trace, flat_costs(), free=[0])


# ---- a draft head's chains -----------------------------------------------------------------------------------------
def test_a_mirror_heads_chains_run_to_the_depth(mirrored):
    target, head = mirrored
    traces = greedy_traces(target, target, PROMPTS, max_new_tokens=12, progress=False)
    for trace, chains in zip(traces, head_chains(target, head, traces, depth=4, progress=False)):
        size = len(trace.new)
        assert chains == [0] + [min(4, size - n) for n in range(1, size)] + [0]


@pytest.mark.parametrize(("k", "scale"), [(2, 0.3), (4, 0.3), (3, 0.6)])
def test_head_chains_give_the_loops_verifies_at_static_k(mirrored, k, scale):
    """A head right part of the time: the static schedule along its teacher-forced chains verifies exactly as often
    as the loop drafting `k` tokens a step with it."""
    target, mirror = mirrored
    head = perturbed(mirror, scale)
    traces = greedy_traces(target, target, PROMPTS, max_new_tokens=16, progress=False)
    chains = head_chains(target, head, traces, depth=k, progress=False)
    assert 0 < sum(map(sum, chains)) < sum(len(t.new) * k for t in traces)  # right part of the time
    for trace, chain in zip(traces, chains):
        ids = torch.tensor([trace.prompt])
        out = target.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16, assistant_model=head,
            custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True,
            dynspec_config=DynSpecConfig(num_speculative_tokens=k, policy="static", proposer="draft", draft_lookahead=0),
        )
        assert out.sequences[0, ids.shape[1] :].tolist() == trace.new
        assert out.dynspec_stats.num_steps == static_schedule(trace, flat_costs(), k, chain).verifies


def test_oracle_prices_a_heads_chains():
    trace = random_trace(seed=5, size=9)
    chains = [0, 3, 0, 2, 5, 1, 0, 1, 0, 0]
    best = fastest_schedule(trace, flat_costs(), chains=chains)
    static = min(static_schedule(trace, flat_costs(), k, chains).seconds for k in range(1, 6))
    assert best.seconds <= static
    assert static_schedule(trace, flat_costs(), 9, [0] + [8 - n for n in range(1, 9)] + [0]).verifies == 1
    with pytest.raises(ValueError, match="one count per new token"):
        fastest_schedule(trace, flat_costs(), chains=chains[:-1])


def test_the_headroom_table_prices_each_proposer_against_a_target_step():
    proposer = {"forward_seconds": 0.05, "mean_chain": {"1": 0.5, "2": 0.75, "4": 0.9}, "right_at_depth": [0.5, 0.5, 0.4],
                "best_static": "2", "static": {"2": {"speedup": 1.3}}, "bound": {"speedup": 1.6, "tokens_per_verify": 2.0}}
    table = headroom_table({"verify_seconds": {"1": 0.5}, "proposers": {"head": proposer}})
    assert table.splitlines()[-1] == "| head | 0.100 | 0.50 / 0.75 / 0.90 | 0.50 / 0.50 / 0.40 | 2 | 1.30x | 1.60x | 2.00 |"


def test_head_chains_refuse_a_depth_below_one(mirrored):
    target, head = mirrored
    traces = greedy_traces(target, target, PROMPTS[:1], max_new_tokens=4, progress=False)
    with pytest.raises(ValueError, match="`depth` must be >= 1"):
        head_chains(target, head, traces, depth=0, progress=False)
