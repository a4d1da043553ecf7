"""How far a lossless chain method can go on a pair of models: where the draft's greedy choice differs from the target's.

With greedy verification a chain is accepted up to the first token where the draft and the target disagree, and the
target's own token there ends the verify. Along the target's greedy output, every position a chain drafts (after the
first new token, which the prefill emits, and before the last, which the final verify emits as its own token) where
the draft's greedy choice differs therefore ends a verify: a call needs that many verifies and a final one, however
long or well-timed its drafts. Where the draft's second choice is the target's token, a token
tree that branches in two there could still carry on.

`fastest_schedule` prices that: with hindsight, the fastest schedule of steps (plain, a draft chain, prompt lookup
alone, or a tree of the draft's first choices) along a greedy trace at a cost model's prices; `copy_matches` gives
what suffix trees over the text and a cache of earlier outputs could propose right. Against each other, the oracles
bound what prompt lookup, suffix trees or trees can add to chains on a pair of models
(`evaluation/lookup_headroom.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..candidates.prompt_lookup import lookup_continuation
from ..cost_models import PaddedCostModel
from ..eagle3 import Eagle3Head
from ..head_training import AuxStates, unroll

RANKS = 8
"""How far down the draft's choices `greedy_traces` looks for the target's token."""


@dataclass
class GreedyTrace:
    """One prompt's target greedy output and, at each of its positions, whether the draft's greedy choice agrees."""

    prompt: list[int]  # the prompt's token ids
    new: list[int]  # the target's plain greedy tokens after it
    agrees: list[bool]  # per new token: the draft's greedy choice after the tokens before it is that token
    second: list[bool]  # per new token: the draft's second choice is that token
    rank: list[int] | None = None  # per new token: its rank among the draft's choices (0: first), -1 past `RANKS`

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "new": self.new, "agrees": self.agrees, "second": self.second, "rank": self.rank}


@dataclass
class Disagreements:
    """One prompt's greedy disagreements between a draft and its target."""

    new_tokens: int  # tokens the target's plain greedy decoding emitted
    disagreements: int  # positions between the first and the last new token where the draft's greedy choice differs
    second_right: int  # of those, positions where the draft's second choice is the target's token

    @property
    def fewest_verifies(self) -> int:
        """Verify forwards any greedy chain method needs: one per disagreement and the final one (none when the
        prefill's token is the only one)."""
        return self.disagreements + int(self.new_tokens > 1)

    @classmethod
    def of(cls, trace: GreedyTrace) -> Disagreements:
        """Count at the positions a chain drafts: not the first new token (the prefill's), nor the last (the final
        verify emits it, drafted or not)."""
        inner = range(1, len(trace.new) - 1)
        wrong = [not trace.agrees[j] for j in inner]
        second = [trace.second[j] for j, w in zip(inner, wrong) if w]
        return cls(len(trace.new), sum(wrong), sum(second))


def _check_request(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be an integer >= 1 (tokens to decode per prompt), got {max_new_tokens!r}.")
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("Every prompt needs at least one token: the draft's guess of the first new token comes after it.")


@torch.no_grad()
def greedy_traces(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    progress: bool = True,
) -> list[GreedyTrace]:
    """For each prompt, decode `max_new_tokens` greedily with `target` alone (stopping at its EOS), then run `draft`
    once over the whole sequence and record, at every new position, whether its first (and second) greedy choice is
    the target's token.

    Args:
        prompts: token ids of each prompt (one row at a time: no padding).
    """
    _check_request(prompts, max_new_tokens)
    traces = []
    for prompt in tqdm(prompts, desc="greedy traces", disable=not progress):
        ids = torch.tensor([list(prompt)], device=target.device)  # [1, prompt]
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        new = out[0, ids.shape[1] :].to(draft.device)  # [new]
        logits = draft(out.to(draft.device)).logits[0, ids.shape[1] - 1 : -1]  # [new, vocab] draft's guess of each
        top = logits.topk(min(RANKS, logits.shape[-1]), dim=-1).indices  # [new, ranks]
        hit = top == new.unsqueeze(1)  # [new, ranks]
        rank = torch.where(hit.any(dim=1), hit.long().argmax(dim=1), -1)  # [new]
        agrees, second = (top[:, 0] == new).tolist(), (top[:, min(1, top.shape[1] - 1)] == new).tolist()
        traces.append(GreedyTrace(list(prompt), new.tolist(), agrees, second, rank.tolist()))
    return traces


@torch.no_grad()
def head_chains(
    target: PreTrainedModel, head: Eagle3Head, traces: Sequence[GreedyTrace], depth: int, progress: bool = True
) -> list[list[int]]:
    """For each trace, `chains[n]` (one per new token and a final 0): how many of the target's tokens from new
    position `n` on a chain of `head` started there drafts right, at most `depth`.

    A head's later tokens read its own states, so unlike a draft model's they depend on where the chain starts: each
    trace takes one target forward and `depth` teacher-forced steps of the training-time test (`unroll`), each token
    reading the state before it as the proposer's tokens do (`HeadInputs.before`: zeros at the first). Step `k` at
    token `i` is what a chain whose first input is token `i` drafts at depth `k` while it is right.
    """
    if depth < 1:
        raise ValueError(f"`depth` must be >= 1 (tokens a chain drafts at most), got {depth}.")
    head.bind(target)
    tap = AuxStates(target, head.aux_layer_ids(target.config.get_text_config().num_hidden_layers))
    chains = []
    try:
        for trace in tqdm(traces, desc="head chains", disable=not progress):
            ids = torch.tensor([trace.prompt + trace.new], device=target.device)  # [1, length]
            target.get_decoder()(input_ids=ids, use_cache=False)
            fused = head.fuse(tap.take())  # [1, length, hidden] the state at each token
            before = torch.cat([torch.zeros_like(fused[:, :1]), fused[:, :-1]], dim=1)  # [1, length, hidden]
            real = torch.ones_like(ids, dtype=torch.bool)
            steps = [head.target_ids[logits[0].argmax(-1)] for logits in unroll(head, before, ids, real, depth)]
            chains.append(_chains(trace, torch.stack(steps).tolist()))  # steps: [depth, length] guessed ids
    finally:
        tap.remove()
    return chains


def _chains(trace: GreedyTrace, guesses: list[list[int]]) -> list[int]:
    """`chains[n]` from `guesses[k][i]`, the head's guess at depth `k` of token `i + 1 + k` of prompt and new tokens."""
    tokens = trace.prompt + trace.new
    chains = [0] * (len(trace.new) + 1)
    for n in range(1, len(trace.new)):  # the chain started after `n` new tokens drafts new token `n` first
        i = len(trace.prompt) + n - 1  # its first input: the last emitted token
        while chains[n] < len(guesses) and i + 1 + chains[n] < len(tokens):
            if guesses[chains[n]][i] != tokens[i + 1 + chains[n]]:
                break
            chains[n] += 1
    return chains


def greedy_disagreements(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    progress: bool = True,
) -> list[Disagreements]:
    """`Disagreements` of each prompt's `greedy_traces`: where the draft's greedy choice differs from the target's
    tokens at the positions a chain drafts (not the first new token, nor the last).

    Args:
        prompts: token ids of each prompt (one row at a time: no padding).
    """
    return [Disagreements.of(trace) for trace in greedy_traces(target, draft, prompts, max_new_tokens, progress)]



# ---- oracle schedules: the fastest a method could decode a greedy trace, knowing it in advance -----------------------
@dataclass(frozen=True)
class OracleCosts:
    """Prices of batch-1 steps for `fastest_schedule`, and what a step may propose."""

    verify: Callable[[int], float]  # seconds of a target forward over `width` new tokens
    draft_forward: float  # seconds of one draft forward
    lookahead: int  # guess tokens a draft forward carries (`DynSpecConfig.draft_lookahead`; 0: none)
    max_draft: int  # most draft-model tokens in one step
    max_lookup: int  # most prompt-lookup tokens in one step
    max_ngram: int = 3
    min_ngram: int = 1

    @classmethod
    def from_cost_model(
        cls, model: PaddedCostModel, lookahead: int, max_draft: int, max_lookup: int, draft_scale: float = 1.0
    ) -> OracleCosts:
        """Batch-1 prices from a fitted cost model (e.g. `ProfileCostModel`), the draft forward scaled by `draft_scale`."""
        if model.verify is None or model.draft is None:
            raise ValueError("The cost model needs both target and draft timings (a profile from `hf-dynspec calibrate`).")
        verify = model.verify
        return cls(
            lambda width: float(verify(np.array([width]))[0]),
            float(model.draft(np.array([1]))[0]) * draft_scale, lookahead, max_draft, max_lookup,
        )


@dataclass
class OracleSchedule:
    """The fastest schedule of one trace: its seconds (prefill excluded) and what it runs."""

    seconds: float
    verifies: int  # target forwards after the prefill, plain steps included
    draft_forwards: int
    lookup_steps: int  # steps that proposed prompt lookup alone


def _agreement_runs(agrees: list[bool]) -> list[int]:
    """`runs[n]`: how many positions from `n` on the draft's greedy choice agrees with the target's, in a row."""
    runs = [0] * (len(agrees) + 1)
    for n in range(len(agrees) - 1, -1, -1):
        runs[n] = runs[n + 1] + 1 if agrees[n] else 0
    return runs


def _lookup_matches(trace: GreedyTrace, costs: OracleCosts) -> list[int]:
    """`matches[n]`: how many tokens of the prompt-lookup continuation after the first `n` new tokens are the target's."""
    tokens = torch.tensor(trace.prompt + trace.new)  # [prompt + new]
    width, start = max(costs.max_lookup, costs.lookahead), len(trace.prompt)
    matches = []
    for n in range(len(trace.new)):
        guess = lookup_continuation(tokens[: start + n], costs.max_ngram, costs.min_ngram, width)  # [found]
        truth = tokens[start + n : start + n + guess.shape[0]]
        same = (guess[: truth.shape[0]] == truth).long().cumprod(0)
        matches.append(int(same.sum()))
    return matches + [0]


def copy_matches(
    trace: GreedyTrace, max_tokens: int, earlier: Sequence[Sequence[int]] = (), max_depth: int = 24,
    spec_factor: float = 1.0,
) -> list[int]:
    """`matches[n]`: with hindsight, the most target tokens after the first `n` new ones that a suffix-tree proposer
    (`proposer="suffix"`, SuffixDecoding) could propose right, at most `max_tokens`.

    Such a proposer matches the text's last tokens (at most `max_depth`) in the text so far and in the `earlier` texts
    of its cache, and proposes what followed an occurrence of the match, at most `spec_factor` tokens per matched
    token (arctic-inference's `max_spec_factor`). A proposal from an occurrence of the text's last token is therefore
    at most the target tokens that followed it, and at most `spec_factor` times how many tokens before it match the
    text's end: the best occurrence bounds chains and every path of a tree.
    """
    tokens = trace.prompt + trace.new
    start, sources = len(trace.prompt), [list(text) for text in earlier]
    indexes = [_positions(source) for source in [tokens] + sources]
    matches = []
    for n in range(len(trace.new)):
        end = start + n  # the text so far is `tokens[:end]`
        truth = tokens[end : end + max_tokens]
        best = 0
        for source, index, limit in zip([tokens] + sources, indexes, [end] + [len(s) for s in sources]):
            for p in index.get(tokens[end - 1], ()) if end else ():
                if p + 1 >= limit:  # the text's own last token, or a source's: nothing followed it yet
                    continue
                right = _common_prefix(source, p + 1, limit, truth)
                if right > best:
                    right = min(right, int(spec_factor * _common_suffix(source, p, tokens, end - 1, max_depth)))
                    best = max(best, right)
        matches.append(best)
    return matches + [0]


def _positions(tokens: Sequence[int]) -> dict[int, list[int]]:
    """Each token's positions in `tokens`, ascending."""
    index: dict[int, list[int]] = {}
    for position, token in enumerate(tokens):
        index.setdefault(token, []).append(position)
    return index


def _common_prefix(source: Sequence[int], begin: int, limit: int, truth: Sequence[int]) -> int:
    """How many of `source[begin:limit]` are `truth`'s first tokens."""
    count = 0
    while count < len(truth) and begin + count < limit and source[begin + count] == truth[count]:
        count += 1
    return count


def _common_suffix(source: Sequence[int], p: int, text: Sequence[int], last: int, most: int) -> int:
    """How many tokens ending at `source[p]` equal those ending at `text[last]`, at most `most`."""
    count = 0
    while count < most and p - count >= 0 and last - count >= 0 and source[p - count] == text[last - count]:
        count += 1
    return count


def _draft_forwards(n: int, longest: int, matches: list[int], lookahead: int) -> list[int]:
    """`forwards[k]` (k = 0..longest): draft forwards that draft the `k` tokens from position `n` on, where the draft
    agrees with the target: each forward yields its own token and as many of its lookahead guesses as hold."""
    starts, position = [], n
    while position < n + longest:
        starts.append(position)
        position += 1 + min(matches[position], lookahead)
    return [sum(start < n + k for start in starts) for k in range(longest + 1)]


def _ranks(trace: GreedyTrace, branching: int) -> list[int]:
    """Each new token's rank among the draft's choices, `-1` where it is not among the first `branching`."""
    if branching == 1:
        return [0 if agrees else -1 for agrees in trace.agrees]
    if trace.rank is None:
        raise ValueError("A trace without draft ranks (`GreedyTrace.rank`) only prices chains: pass `branching=1`.")
    if not 1 <= branching <= RANKS:
        raise ValueError(f"`branching` must be between 1 and {RANKS} (the ranks a trace records), got {branching}.")
    return [rank if 0 <= rank < branching else -1 for rank in trace.rank]


def fastest_schedule(
    trace: GreedyTrace, costs: OracleCosts, lookup: bool = False, branching: int = 1, max_nodes: int | None = None,
    free: list[int] | None = None, chains: list[int] | None = None,
) -> OracleSchedule:
    """The fastest way, with hindsight, to decode `trace` in greedy steps (the prefill's token is free).

    At each position a step either decodes plainly, or drafts `k` tokens with the draft model where the draft agrees
    (its draft lookahead saving forwards where prompt lookup guesses right), or, with `lookup`, proposes `j` tokens of
    the prompt-lookup continuation where they are the target's (no draft forward); it emits them and the target's
    bonus token. Hindsight cuts every proposal at its last right token, and catch-ups of the draft are not priced, so
    this bounds what any method of that kind achieves at these prices.

    With `branching > 1` the draft proposes token trees whose children are its first choices (as trees grown by
    cumulative draft probability are): a tree follows the target through a position where the target's token is the
    draft's `r`-th choice (`r < branching`) only if it also holds the `r` choices above it, so a `k`-deep path costs
    `k` plus the sum of those ranks in nodes (at most `max_nodes`), one draft forward per depth.

    `free` (implies `lookup`) replaces prompt lookup's right tokens per position by another model-free proposer's,
    e.g. `copy_matches` for suffix trees; draft lookahead still guesses by prompt lookup.

    `chains` (one count per new token and a final 0) replaces the draft's agreement runs by chains that depend on
    where they start, e.g. a draft head's (`head_chains`); chains only (`branching=1`).
    """
    size = len(trace.new)
    ranks = _ranks(trace, branching)
    runs, matches = _agreement_runs([rank >= 0 for rank in ranks]), _lookup_matches(trace, costs)
    if free is not None and len(free) != size + 1:
        raise ValueError(f"`free` needs one count per new token and a final 0 ({size + 1}), got {len(free)}.")
    if chains is not None:
        if len(chains) != size + 1 or branching != 1:
            raise ValueError(f"`chains` needs one count per new token and a final 0 ({size + 1}), got {len(chains)}, "
                             f"and prices chains only (`branching=1`, got {branching}).")
        runs, ranks = chains, [0] * size  # a chain is one node per token
    lookup, free = lookup or free is not None, matches if free is None else free
    best = [0.0] * (size + 1)  # seconds from position n (n tokens emitted) to the end
    plan: list[tuple[str, int, int]] = [("end", 0, 0)] * (size + 1)  # (kind, tokens proposed, draft forwards)
    for n in range(size - 1, 0, -1):
        room = size - n - 1  # most tokens a step may propose: its bonus token emits the last
        options = [(costs.verify(1) + best[n + 1], ("plain", 0, 0))]
        longest, nodes = min(runs[n], costs.max_draft, room), 0
        for k, forwards in enumerate(_draft_forwards(n, longest, matches, costs.lookahead)[1:], start=1):
            nodes += 1 + ranks[n + k - 1]
            if max_nodes is not None and nodes > max_nodes:
                break
            seconds = forwards * costs.draft_forward + costs.verify(nodes + 1) + best[n + k + 1]
            options.append((seconds, ("draft", k, forwards)))
        for j in range(1, min(free[n], costs.max_lookup, room) + 1) if lookup else ():
            options.append((costs.verify(j + 1) + best[n + j + 1], ("lookup", j, 0)))
        best[n], plan[n] = min(options, key=lambda option: option[0])
    return _replay(best, plan, size)


def draft_chains(trace: GreedyTrace, depth: int) -> list[int]:
    """A draft model's chains in `head_chains`' form: its agreement runs from each new position, at most `depth`."""
    return [0] + [min(run, depth) for run in _agreement_runs(trace.agrees)[1:]]


def static_schedule(trace: GreedyTrace, costs: OracleCosts, k: int, chains: list[int] | None = None) -> OracleSchedule:
    """Drafting `k` tokens at every step (fewer where the call ends sooner), as `policy="static"` does without
    lookahead: its seconds and forwards along `trace`, chains as in `fastest_schedule`."""
    chains = draft_chains(trace, k) if chains is None else chains
    schedule, n = OracleSchedule(0.0, 0, 0, 0), 1
    while n < len(trace.new):
        drafted = min(k, len(trace.new) - n - 1)  # the final verify's own token emits the last
        schedule.seconds += drafted * costs.draft_forward + costs.verify(drafted + 1)
        schedule.verifies += 1
        schedule.draft_forwards += drafted
        n += min(chains[n], drafted) + 1
    return schedule


def _replay(best: list[float], plan: list[tuple[str, int, int]], size: int) -> OracleSchedule:
    """Count what the chosen steps run, from the prefill's token to the end."""
    schedule, n = OracleSchedule(best[1] if size > 1 else 0.0, 0, 0, 0), 1
    while n < size:
        kind, proposed, forwards = plan[n]
        schedule.verifies += 1
        schedule.draft_forwards += forwards
        schedule.lookup_steps += kind == "lookup"
        n += proposed + 1
    return schedule


def headroom_table(results: dict) -> str:
    """The markdown table `evaluation/head_headroom.py` prints for its results (`"scenario": "head_headroom"`): per
    proposer, its forward's cost in target steps, the tokens its chains get right, the best fixed length at the
    prices timed, and the hindsight bound, both as speed over plain decoding."""
    lines = [
        "| method | forward / target step | right of 1 / 2 / 4 | right at depth 1 / 2 / 3 | best static | x plain "
        "| hindsight bound | bound's tokens / verify |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    step = results["verify_seconds"]["1"]
    for name, r in results["proposers"].items():
        best = r["best_static"]
        chain = " / ".join(f"{r['mean_chain'][k]:.2f}" for k in ("1", "2", "4"))
        depth = " / ".join(f"{share:.2f}" for share in r["right_at_depth"][:3])
        lines.append(
            f"| {name} | {r['forward_seconds'] / step:.3f} | {chain} | {depth} | {best} | "
            f"{r['static'][best]['speedup']:.2f}x | {r['bound']['speedup']:.2f}x | "
            f"{r['bound']['tokens_per_verify']:.2f} |"
        )
    return "\n".join(lines)
