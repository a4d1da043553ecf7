"""`evaluation/probes/suffix_confidence.py`: suffix proposals replayed against outputs, by match length and share."""

from __future__ import annotations

from conftest import evaluation_script


def test_replay_counts_confirmed_tokens_by_match_and_share():
    probe = evaluation_script("suffix_confidence")
    # The first request writes 12 13 14 15 (its output alone goes to the global tree). The second's prompt ends in
    # 12 13 and it writes 14 16: after its prompt it is proposed 14 15 (sure, a match of 2), 14 confirmed and 15 not;
    # after 14, 15 again (a match of 3), not confirmed. Short matches both, every share 1.
    counts = probe.replay([[11], [30, 11, 12, 13]], [[12, 13, 14, 15], [14, 16]])
    assert counts == {"short 1": [3, 1]}
    assert probe.share_class(1.0) == "1" and probe.share_class(0.6) == "0.5-1" and probe.share_class(0.2) == "<0.5"
