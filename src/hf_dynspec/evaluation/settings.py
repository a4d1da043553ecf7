"""What defines a benchmark run (`BenchSettings`, stored as `config` in the results) and the documented scenarios."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .models import (
    DTYPE_CHOICES,
    QUANTIZATIONS,
    LoadOptions,
    default_cache_dir,
    split_variant,
)

SCENARIOS: dict[str, dict[str, Any]] = {
    "fixed": dict(
        dataset="humaneval",
        num_prompts=16,
        batch_sizes=[1, 4, 16],
        max_new_tokens=128,
        methods="plain,hf-assisted,hf-heuristic,hf-prompt-lookup,dynspec-static:4,dynspec-goodput",
        output_lengths="eos",
    ),
    "long-tail": dict(
        dataset="humaneval",
        num_prompts=32,
        batch_sizes=[32],
        max_new_tokens=256,
        methods="plain,dynspec-static:4,dynspec-goodput",
        output_lengths="long-tail",
    ),
    "mixed": dict(
        dataset="mixed",
        num_prompts=16,
        batch_sizes=[16],
        max_new_tokens=128,
        methods="plain,dynspec-static:4,dynspec-goodput",
        output_lengths="eos",
    ),
    "offload": dict(
        dataset="humaneval",
        num_prompts=16,
        batch_sizes=[1],
        max_new_tokens=48,
        methods="plain,hf-assisted,hf-assisted+rowmajor,dynspec-goodput@marginal:16,dynspec-tree:32:40",
        policy_options={
            "goodput@marginal": {"early_stop": "marginal", "prefill_draft_confidence": 0.4},
            "tree": {"early_stop": "marginal", "prefill_draft_confidence": 0.4, "tree_branching": 3,
                     "tree_stop_judges": "tree"},
        },
        output_lengths="eos",
        # the default target keeps 35% of its weights in memory (embeddings and the first layers: 1.1 GB in
        # bfloat16, 2.2 GB in float32); accelerate reads the other layers from the offload folder in every forward,
        # so a target step is dominated by reading weights (docs/benchmarks.md, "Where an offloaded step goes") and
        # each target forward saved is worth far more than a draft forward: goodput may draft up to 16 tokens and
        # ends each draft with the marginal stop; trees up to 40 deep with 32 nodes and 3 children per node, ended by
        # the same stop judging the whole tree at each depth; the prefill's forward verifies the first drafts (a
        # target forward fewer per call)
        target_max_memory={"cpu": "35%"},
        target_offload_folder=str(default_cache_dir() / "offload" / "target"),
    ),
    "rollout": dict(
        dataset="sharegpt",
        num_prompts=2,
        samples_per_prompt=8,
        batch_sizes=[16],
        max_new_tokens=512,
        methods="plain,dynspec-nospec,dynspec-goodput,dynspec-static:2,dynspec-prompt-lookup:4,dynspec-hybrid,"
                "dynspec-suffix,dynspec-suffix+warm",
        output_lengths="eos",
        # an RL rollout as TRL's GRPOTrainer generates it: each prompt's samples in adjacent rows, sampled at
        # temperature 1 over the whole vocabulary, each row ending at its own EOS (a long tail of a few long rows)
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    ),
    "rollout-epochs": dict(
        # the rollout scenario's prompts and sampling, sampled again after GRPO updates of the policy
        # (`hf_dynspec.evaluation.epochs`): the methods time the second epoch
        dataset="sharegpt",
        num_prompts=2,
        samples_per_prompt=8,
        batch_sizes=[16],
        max_new_tokens=512,
        methods="dynspec-nospec,dynspec-nospec@coupled,dynspec-goodput,dynspec-reuse:32,dynspec-reuse:32+draft",
        output_lengths="eos",
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    ),
    "serve": dict(
        # requests arriving at random times (Poisson) into transformers' continuous batching, at a sweep of rates up
        # to saturation (`hf_dynspec.evaluation.serve`); greedy, each request ending at its own EOS
        dataset="sharegpt",
        num_prompts=16,
        batch_sizes=[16],
        max_new_tokens=64,
        methods="cb-plain,cb-suffix-static:4,cb-suffix",
        output_lengths="eos",
    ),
}
"""Presets for the documented scenarios; explicit settings override them."""

OUTPUT_LENGTHS = ("eos", "long-tail")
TINY_UNSUPPORTED = tuple(
    f"{role}_{option}" for role in ("target", "draft") for option in ("quantization", "max_memory", "offload_folder")
)


@dataclass
class BenchSettings:
    """Everything that defines a benchmark run (stored as `config` in the results)."""

    target: str = "qwen2.5-coder-1.5b"
    draft: str | None = "qwen2.5-coder-0.5b"
    dataset: str = "humaneval"
    num_prompts: int = 16
    prompt_offset: int = 0
    """Prompts of the dataset skipped before the first one used (random prompts too, with `tiny`): a held-out set."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    max_new_tokens: int = 128
    methods: str = "plain,hf-assisted,dynspec-static:4"
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    repetitions: int = 2
    warmup_tokens: int = 8
    do_sample: bool = False
    seed: int = 0
    max_prompt_tokens: int = 768
    output_lengths: str = "eos"
    """`eos`: rows stop at EOS or `max_new_tokens`; `long-tail`: each row also has its own budget (see `long_tail_budgets`)."""
    batch_size_prompts: dict[int, int] = field(default_factory=dict)
    """Optional smaller prompt count per batch size, e.g. `{1: 4}` (batch size 1 is the slowest per prompt)."""
    tiny: bool = False
    dtype: str = "auto"
    """Weights dtype of both models: `auto` is what a user gets (see `models.resolve_dtype`), or a dtype name."""
    target_dtype: str | None = None
    """Overrides `dtype` for the target."""
    draft_dtype: str | None = None
    """Overrides `dtype` for the draft (a `@bf16` draft variant overrides both)."""
    target_quantization: str = "none"
    """`none`, `8bit` or `4bit` (bitsandbytes)."""
    draft_quantization: str = "none"
    target_max_memory: dict[int | str, str] | None = None
    """accelerate's `max_memory` for the target, e.g. `{"cpu": "1GiB"}` or a share of its weights, `{"cpu": "35%"}`
    (the rest is offloaded)."""
    target_offload_folder: str | None = None
    """Directory for the target's weights offloaded to disk."""
    draft_max_memory: dict[int | str, str] | None = None
    draft_offload_folder: str | None = None
    samples_per_prompt: int = 1
    """Rows per prompt, adjacent in the batch (TRL's `num_generations` layout): `num_prompts * samples_per_prompt` rows."""
    temperature: float | None = None
    """Sampling settings of every call (`None`: the target's generation config decides)."""
    top_p: float | None = None
    top_k: int | None = None
    scenario: str | None = None
    rates: list[float | str] | None = None
    """Serve scenario: request rates (requests/s), or shares of the plain manager's measured capacity (`"0.5x"`);
    `None`: `evaluation.serve.DEFAULT_RATE_SHARES`."""
    loaded_models: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Filled by `load_inputs`: per model the requested and resolved dtype and the placement options used."""

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"`num_prompts` must be at least 1, got {self.num_prompts}.")
        if self.samples_per_prompt < 1:
            raise ValueError(f"`samples_per_prompt` must be at least 1, got {self.samples_per_prompt}.")
        if self.prompt_offset < 0:
            raise ValueError(f"`prompt_offset` must be 0 or more (prompts to skip), got {self.prompt_offset}.")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"`batch_sizes` must be positive integers, got {self.batch_sizes}.")
        if self.repetitions < 1:
            raise ValueError(f"`repetitions` must be at least 1, got {self.repetitions}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be at least 1, got {self.max_new_tokens}.")
        if self.output_lengths not in OUTPUT_LENGTHS:
            raise ValueError(f"`output_lengths` must be one of {OUTPUT_LENGTHS}, got {self.output_lengths!r}.")
        for name in ("dtype", "target_dtype", "draft_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPE_CHOICES:
                raise ValueError(f"`{name}` must be one of {', '.join(DTYPE_CHOICES)}, got {value!r}.")
        for name in ("target_quantization", "draft_quantization"):
            if getattr(self, name) not in QUANTIZATIONS:
                raise ValueError(f"`{name}` must be one of {', '.join(QUANTIZATIONS)}, got {getattr(self, name)!r}.")
        for name in ("target", "draft"):
            if getattr(self, name):
                split_variant(getattr(self, name))  # raises for an unknown variant of a registry name
        placed = [name for name in TINY_UNSUPPORTED if getattr(self, name) not in (None, "none")]
        if self.tiny and placed:
            raise ValueError(
                f"tiny models are built in memory and only take a dtype; {', '.join(placed)} do not apply to them. "
                "Drop those settings (or the offload scenario), or benchmark real models without --tiny."
            )

    def load_options(self, role: str) -> tuple[str, LoadOptions]:
        """`(model name without variant, LoadOptions)` of the `"target"` or `"draft"` model."""
        name, variant = split_variant(getattr(self, role))
        options = LoadOptions(
            dtype=getattr(self, f"{role}_dtype") or self.dtype,
            quantization=getattr(self, f"{role}_quantization"),
            max_memory=getattr(self, f"{role}_max_memory"),
            offload_folder=getattr(self, f"{role}_offload_folder"),
        )
        return name, options.with_variant(variant)

    def prompts_for(self, batch_size: int) -> int:
        """Rows run at `batch_size`: its prompts times `samples_per_prompt`."""
        return self.samples_per_prompt * min(self.num_prompts, self.batch_size_prompts.get(batch_size, self.num_prompts))

    @property
    def sampling(self) -> dict[str, float]:
        """The sampling settings given (`temperature`, `top_p`, `top_k`), for every sampled call."""
        return {name: getattr(self, name) for name in ("temperature", "top_p", "top_k") if getattr(self, name) is not None}

    @property
    def records_timeline(self) -> bool:
        """Whether runs record active rows over time: when rows of one batch end at different steps (samples of a
        prompt, row budgets)."""
        return self.samples_per_prompt > 1 or self.output_lengths == "long-tail"
