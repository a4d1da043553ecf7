"""Saving a trained EAGLE-3 head (`hf_dynspec.head_training`) in the `speculators` format, with its training log and
plot: the folder `Eagle3Head.from_pretrained` loads and vLLM serves."""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from .eagle3 import Eagle3Head
from .head_training import SPECULATORS_VERSION, HeadTrainingLog, HeadTrainingSettings


def speculators_config(
    head: Eagle3Head, verifier: str | None, verifier_architectures: Sequence[str], speculative_tokens: int = 3,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """The `speculators` format's `config.json` for `head` (see tests/fixtures/heads/README.md)."""
    layer = head.config.to_dict()
    for key in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype", "output_attentions",
                "output_hidden_states", "return_dict", "chunk_size_feed_forward", "problem_type",
                "tokenizer_class", "id2label", "label2id"):
        layer.pop(key, None)
    layer = {k: v for k, v in layer.items() if not k.startswith("_")}
    layer.update(model_type="llama", num_hidden_layers=len(head.layers), layer_types=["full_attention"] * len(head.layers))
    settings = head.settings
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": settings.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(settings.aux_layer_ids) if settings.aux_layer_ids else None,
        "norm_before_residual": settings.norm_before_residual,
        "norm_before_fc": settings.norm_before_fc,
        "fc_norm": settings.fc_norm,
        "norm_output": settings.norm_output,
        "target_hidden_size": settings.target_hidden_size,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }


def save_head(
    head: Eagle3Head, folder: str | Path, target: PreTrainedModel, verifier: str | None = None,
    speculative_tokens: int = 3, dtype: torch.dtype | None = None,
) -> Path:
    """Write `head` in the `speculators` format: `config.json` and `model.safetensors` (`fc.weight`, `layers.*`,
    `norm.weight`, `lm_head.weight`, `input_norm.weight` with `norm_before_fc`, `d2t`, `t2d`; no embeddings, which
    vLLM and `Eagle3Head.from_pretrained` take from the target). Floating weights in `dtype` (default: the target's
    when bfloat16 or float16, else float32)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if dtype is None:
        dtype = target.dtype if target.dtype in (torch.bfloat16, torch.float16) else torch.float32
    weights = {}
    for name, tensor in head.state_dict().items():
        if name.startswith(("embed_tokens", "rotary_emb")):
            continue
        tensor = tensor.detach().cpu()
        weights[name] = tensor.to(dtype).contiguous() if tensor.is_floating_point() else tensor.contiguous()
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    t2d[head.target_ids.cpu()] = True
    weights["t2d"] = t2d
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    architectures = getattr(target.config, "architectures", None) or [type(target).__name__]
    config = speculators_config(head, verifier, architectures, speculative_tokens, dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


def versions() -> dict:
    import transformers

    from . import __version__ as ours

    return {"hf_dynspec": ours, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "speculators_format": SPECULATORS_VERSION}


def write_log(folder: str | Path, log: HeadTrainingLog, settings: HeadTrainingSettings, extra: dict | None = None) -> Path:
    """`training.json`: settings, versions, the run's summary and its per-step records."""
    path = Path(folder) / "training.json"
    summary = {k: v for k, v in asdict(log).items() if k != "records"}
    payload = {"settings": asdict(settings), "versions": versions(), **summary, **(extra or {}), "records": log.records}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def plot_log(folder: str | Path, log: HeadTrainingLog) -> Path | None:
    """`training.png`: the loss and the per-step chain acceptance against the step (None without matplotlib or
    records)."""
    if not log.records:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r["step"] for r in log.records]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(steps, [r["loss"] for r in log.records], label="weighted loss (all steps)")
    left.plot(steps, [r["step_loss"][0] for r in log.records], label="step 0 KL", alpha=0.7)
    left.set_xlabel("training step")
    left.set_ylabel("KL divergence (nats)")
    left.set_yscale("log")
    left.legend()
    for k in range(len(log.records[-1]["acceptance"])):
        right.plot(steps, [r["acceptance"][k] if k < len(r["acceptance"]) else float("nan") for r in log.records],
                   label=f"chain of {k + 1} accepted")
    right.plot(steps, [r["accuracy"][0] for r in log.records], label="step 0 top-1", linestyle=":")
    right.set_xlabel("training step")
    right.set_ylabel("share of positions")
    right.set_ylim(0, 1)
    right.legend()
    figure.suptitle("EAGLE-3 head training: loss and acceptance (teacher-forced, training batches)")
    figure.tight_layout()
    path = Path(folder) / "training.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
