"""The overlap probe (`evaluation/probes/draft_during_verify.py --overlap prepare`): doing accelerate's pre-forward work for
a disk-offloaded model ahead of its forward must leave the forward's output unchanged and the weights offloaded."""

from __future__ import annotations

import pytest
import torch
from conftest import evaluation_script, tiny_model
from transformers import AutoModelForCausalLM

# the second layer and the head on disk, read by accelerate's hooks in every forward
DEVICE_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
              "model.rotary_emb": "cpu", "lm_head": "disk"}


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    tiny_model("llama", seed=0).save_pretrained(root / "model")
    model = AutoModelForCausalLM.from_pretrained(
        root / "model", dtype=torch.float64, device_map=DEVICE_MAP, offload_folder=root / "offload"
    )
    return model.eval()


def offloaded_weights(model) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]


def test_prepared_forward_matches_and_puts_weights_back(offloaded):
    probe = evaluation_script("draft_during_verify")
    ids = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        reference = offloaded(input_ids=ids).logits
        prepare = probe._offloaded_preparer(offloaded)
        assert offloaded_weights(offloaded) and all(w.device.type == "meta" for w in offloaded_weights(offloaded))
        prepare()
        assert all(w.device.type == "cpu" for w in offloaded_weights(offloaded))  # read ahead of the forward
        prepared = offloaded(input_ids=ids).logits
        assert all(w.device.type == "meta" for w in offloaded_weights(offloaded))  # the post-forward still ran
        again = offloaded(input_ids=ids).logits  # not prepared: the hooks read the weights themselves
    assert torch.equal(prepared, reference) and torch.equal(again, reference)


@pytest.mark.parametrize("argv", [["--draft-threads", "0"], ["--overlap", "prepare", "--draft-threads", "1"]])
def test_draft_threads_must_be_positive_and_for_the_draft_overlap(argv, capsys):
    probe = evaluation_script("draft_during_verify")
    with pytest.raises(SystemExit):
        probe.parse_args(argv)
    err = capsys.readouterr().err
    assert "give a thread count >= 1, with --overlap draft" in err
    assert probe.parse_args(["--draft-threads", "1"]).draft_threads == 1
