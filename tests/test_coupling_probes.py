"""The coupled-sampling probes: context keys' hindsight schedule by hand, and the sampler cost probe runs."""

from __future__ import annotations

from conftest import evaluation_script

context_keys = evaluation_script("context_keys")
coupled_cost = evaluation_script("coupled_cost")


def test_context_widths_follow_the_earlier_sample_after_a_shift():
    prompt = [50, 51, 52, 53]
    earlier = [1, 2, 3, 4, 5, 6, 7, 8]
    shifted = [1, 9, 2, 3, 4, 5, 6, 7, 8]  # one token inserted: position keys lose the rest, context keys re-join
    assert context_keys.oracle_widths(earlier, shifted) == [1] * 8
    widths = context_keys.context_widths(earlier, shifted, prompt)
    assert sum(widths) == len(shifted) - 1 and len(widths) < 8
    assert context_keys.context_widths(earlier, earlier, prompt) == [len(earlier) - 1]


def test_context_keys_never_repeat_within_a_row():
    from collections import Counter

    seen, keys, row = Counter(), [], []
    for token in [5, 5, 5, 5, 5, 5, 5, 5]:  # one context over and over: its count keeps the keys apart
        keys.append(context_keys.context_key(row, [1, 2, 3, 4], seen))
        seen[tuple(([1, 2, 3, 4] + row)[-context_keys.CONTEXT :])] += 1
        row.append(token)
    assert len(set(keys)) == len(keys)


def test_the_cost_probe_times_both_samplers():
    timing = coupled_cost.sampler_seconds(rows=1, draft=1, repeats=1)
    assert timing["standard"] > 0 and timing["coupled"] > 0
