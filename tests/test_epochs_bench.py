"""The rollout-epochs scenario: its pieces by hand, and the whole of it on tiny models through the command line."""

from __future__ import annotations

import json

import pytest

from hf_dynspec.cli import main
from hf_dynspec.evaluation.epochs import COUPLED, EpochSettings, agreement, hindsight_bound, oracle_widths


def test_oracle_widths_take_every_repeated_token_and_one_more():
    earlier = [7, 1, 2, 3, 9, 5, 6]
    row = [7, 1, 2, 3, 4, 5, 6, 8]
    # after the prefill's token: 1 2 3 proposed right and 4 added; then 5 6 right and 8 added
    assert oracle_widths(earlier, row) == [4, 3]
    assert oracle_widths(earlier, row, max_tokens=2) == [3, 1, 3]
    assert oracle_widths([], row) == [1] * 7  # nothing to reuse: the loop without speculation
    assert oracle_widths(row, row) == [7]  # the whole row in one verify (the last token is the target's own)


def test_oracle_widths_by_context_re_join_after_an_inserted_token():
    prompt = [4, 4, 4, 4]
    earlier = [1, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    row = [1, 2, 0, 3, 5, 6, 7, 8, 9, 10, 11, 12]  # a token inserted: by position nothing lines up again
    assert oracle_widths(earlier, row, prompt=prompt) == [2] + [1] * 9
    # by context: the windows that hold the inserted 0 never occurred earlier; once the last four tokens are 3 5 6 7
    # again, the earlier 8 9 10 11 are proposed in one verify, and the target adds 12
    assert oracle_widths(earlier, row, prompt=prompt, keying="context") == [2, 1, 1, 1, 1, 5]


def test_agreement_counts_positions_prefixes_and_rows():
    first = [[1, 2, 3], [4, 5, 6, 7]]
    second = [[1, 2, 3], [4, 9, 6]]
    shares = agreement(first, second)
    assert shares["identical_rows"] == 1 and shares["rows"] == 2
    assert shares["token_agreement"] == pytest.approx(5 / 6)
    assert shares["shared_prefix_share"] == pytest.approx(4 / 6)


def test_hindsight_bound_prices_forwards_by_active_rows():
    timeline = [(0.0, 2), (1.0, 2), (2.0, 2), (3.0, 1), (3.5, 0)]  # prefill, then forwards at 2, 2 and 1 rows
    run = {"timelines": [{"method": COUPLED, "calls": [timeline, timeline]}]}
    first = [[1, 2, 3, 4], [5, 6, 7]]
    bound = hindsight_bound(first, first, run)  # the second epoch repeats the first: one verify per row
    # the loop without speculation: prefill (1 s) + forwards at 2, 2 rows and 1 row (1 + 1 + 0.5 s)
    assert bound["speedup_over_nospec"] == pytest.approx(3.5 / 2.0)
    assert bound["forwards"] == 4
    unrelated = hindsight_bound([[9, 9, 9, 9], [9, 9, 9]], first, run)
    assert unrelated["speedup_over_nospec"] == pytest.approx(1.0)


def test_epoch_settings_are_checked():
    with pytest.raises(ValueError, match="updates"):
        EpochSettings(updates=[0])
    assert EpochSettings(updates=[4, 1, 4]).updates == [1, 4]


def test_rollout_epochs_on_tiny_models(tmp_path, capsys):
    out = tmp_path / "epochs.json"
    code = main(["bench", "--scenario", "rollout-epochs", "--tiny", "--num-prompts", "2", "--samples-per-prompt", "3",
                 "--max-new-tokens", "16", "--repetitions", "1", "--updates", "1,2", "--quiet", "--out", str(out),
                 "--plots", str(tmp_path / "plots"), "--first-epoch-methods", "dynspec-nospec,dynspec-nospec@coupled"])
    assert code == 0
    results = json.loads(out.read_text())
    assert [epoch["updates"] for epoch in results["second_epoch"]] == [1, 2]
    for epoch in results["second_epoch"]:
        runs = {r["method"]: r for r in epoch["results"]["runs"]}
        coupled = [name for name in runs if name != "dynspec-nospec" and name != "dynspec-goodput"]
        assert all(runs[name]["rows"] == runs[COUPLED]["rows"] for name in coupled)  # one seed, the same rows
        assert runs["dynspec-reuse:32"]["reused_tokens"] > 0
        assert 0.0 <= epoch["agreement"]["token_agreement"] <= 1.0 and epoch["kl_per_token"] > -1e-6
        assert epoch["bound"]["speedup_over_nospec"] >= 1.0
    assert (tmp_path / "plots" / "epochs_speed_kl.png").is_file()
    printed = capsys.readouterr().out
    assert "First epoch" in printed and "After 2 update(s)" in printed
