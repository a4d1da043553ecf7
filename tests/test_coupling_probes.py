"""The coupled-sampling probes: what the context-keys probe counts, by hand, and the sampler cost probe runs."""

from __future__ import annotations

from conftest import evaluation_script

context_keys = evaluation_script("context_keys")
coupled_cost = evaluation_script("coupled_cost")


def test_the_probe_counts_what_each_keying_re_joins_after_a_shift():
    prompt = [50, 51, 52, 53]
    earlier = [1, 2, 3, 4, 5, 6, 7, 8]
    shifted = [1, 9, 2, 3, 4, 5, 6, 7, 8]  # one token inserted: position keys lose the rest, context keys re-join
    by_position = context_keys.summary([prompt], [earlier], [shifted], "position")
    by_context = context_keys.summary([prompt], [earlier], [shifted], "context")
    assert by_position["forwards"] == 8 and by_position["reusable_share"] == 0
    assert by_context["forwards"] < 8 and by_context["reusable_share"] > 0
    assert context_keys.summary([prompt], [earlier], [earlier], "context")["identical_rows"] == 1


def test_the_cost_probe_times_both_samplers():
    timing = coupled_cost.sampler_seconds(rows=1, draft=1, repeats=1)
    assert timing["standard"] > 0 and timing["coupled"] > 0
