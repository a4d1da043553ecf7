"""Settings of the speculative loop: [`DynSpecConfig`]."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .coupling import KEYINGS, SAMPLERS
from .kernels import NARROW_LINEAR

if TYPE_CHECKING:
    from transformers import GenerationConfig

PROPOSERS = ("auto", "draft", "hybrid", "suffix")
"""Values of `DynSpecConfig.proposer`."""
TREE_STOP_JUDGES = ("best", "tree")
"""What a policy's early stop judges at each depth of a draft-model tree (`DynSpecConfig.tree_stop_judges`)."""

GENERATION_CONFIG_KEY = "dynspec"
"""Key under which the settings live in a model's `generation_config.json`."""


@dataclass
class DynSpecConfig:
    """Settings of the speculative loop, passed to `generate` as `dynspec_config=`.

    Every field is validated on construction; an invalid value raises `ValueError` naming the field. The policy's name
    and its `policy_options` are checked when the policy is built, at the first `generate` call, so that a config can
    name a policy registered in `hf_dynspec.policies.POLICIES` after it was made (or saved).

    Example:

    ```python
    >>> from hf_dynspec import DynSpecConfig
    >>> config = DynSpecConfig(num_speculative_tokens=4, policy="static")
    ```
    """

    num_speculative_tokens: int = field(
        default=4,
        metadata={"help": "Maximum number of draft tokens a row may speculate in one step (the `static` policy's "
                  "length; the bound of every other policy)."},
    )
    policy: str = field(
        default="goodput",
        metadata={"help": "Name of the policy that chooses each row's draft length every step (see `hf_dynspec.policies`). "
                  "The default, 'goodput', learns acceptance and costs online and drafts only where it expects to "
                  "gain, within a loss budget against plain decoding; 'static' always drafts the maximum."},
    )
    policy_options: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "Policy-specific settings, validated by the policy when it is built."},
    )
    proposer: str = field(
        default="auto",
        metadata={"help": "Where draft tokens come from: 'auto' (with an assistant model, per row and step a copy from "
                  "the context or the assistant model, whose forwards also check the copy: draft lookahead, as the "
                  "policy decides; copies come from suffix trees when the `suffix` extra is installed, else from prompt "
                  "lookup; token trees and a draft with another tokenizer take the assistant model alone; without an "
                  "assistant model, prompt lookup), 'draft' (the assistant model alone), 'hybrid' (per row and step, "
                  "prompt lookup or the assistant model, as the policy decides), "
                  "'suffix' (suffix trees over the row's prompt, every output of the call so far and the outputs of "
                  "earlier calls, `hf_dynspec.candidates.suffix`; with an assistant model, per row and step the suffix "
                  "proposal or the model, as the policy decides). 'suffix' needs the `suffix` extra."},
    )
    tree_node_budget: int = field(
        default=0,
        metadata={"help": "Token trees: most draft nodes per row and step (the policy may choose fewer); "
                  "`num_speculative_tokens` caps the depth. 0 proposes chains."},
    )
    tree_branching: int = field(
        default=2,
        metadata={"help": "Draft-model trees: children of each expanded node, and nodes expanded per depth (under "
                  "continuous batching only the chain's nodes are expanded)."},
    )
    tree_stop_judges: str = field(
        default="best",
        metadata={"help": "Draft-model trees under a policy's early stop: what the stop judges at each depth. 'best': "
                  "the draft's probability of the depth's most valuable node given its parent (the tree judged as "
                  "its best chain); 'tree': the draft's probability that the path reaches the depth's nodes given "
                  "it reached the previous depth's (siblings count)."},
    )
    tree_min_node_probability: float = field(
        default=0.0,
        metadata={"help": "Draft-model trees in greedy decoding: a node is proposed only if the draft's probability of "
                  "its whole path is at least this (each row keeps its most valuable node). Such nodes are rarely "
                  "the target's choice, and every proposed node widens the verify forward. 0 keeps the node budget's "
                  "most valuable nodes whatever their probability. Under continuous batching, where a draft "
                  "model's nodes are its most likely tokens in sampling too, it applies to both."},
    )
    prompt_lookup_max_ngram: int = field(
        default=3,
        metadata={"help": "Longest n-gram the prompt-lookup proposer tries to match (it falls back to shorter ones)."},
    )
    prompt_lookup_min_ngram: int = field(
        default=1,
        metadata={"help": "Shortest n-gram the prompt-lookup proposer accepts as a match."},
    )
    prompt_lookup_max_tokens: int = field(
        default=10,
        metadata={"help": "Most tokens a row may propose in one step from prompt lookup: a hybrid proposer's lookup "
                  "rows, and draft tokens that lookahead yields past the row's length. They cost no draft forward, "
                  "only verify width; `num_speculative_tokens` caps the tokens each drafted with a forward of its own."},
    )
    suffix_max_depth: int = field(
        default=24,
        metadata={"help": "Suffix proposer: longest match of a row's end in the suffix trees (their depth)."},
    )
    suffix_cache_outputs: int = field(
        default=256,
        metadata={"help": "Suffix proposer: outputs its global suffix tree keeps, those of running rows included "
                  "(oldest out first): at least the batch size, so rows of one call see each other's outputs, and "
                  "what is left over serves later calls of the same target model."},
    )
    suffix_cache_tokens: int = field(
        default=262144,
        metadata={"help": "Suffix proposer: tokens of those outputs kept, at most (oldest out first); a suffix tree "
                  "takes on the order of `suffix_max_depth` nodes per token."},
    )
    suffix_min_token_probability: float = field(
        default=0.1,
        metadata={"help": "Suffix proposer: a token is proposed only if it followed its path at least this often "
                  "(its estimated probability)."},
    )
    suffix_spec_factor: float = field(
        default=1.0,
        metadata={"help": "Suffix proposer: a row proposes at most this many tokens per token of its match."},
    )
    draft_lookahead: int = field(
        default=8,
        metadata={"help": "Draft model: prompt-lookup guesses of the draft's next tokens fed along with each draft "
                  "forward, shared among the rows still drafting. Where the draft's own tokens match the guess, one "
                  "forward yields several draft tokens; a chain's tokens are the same as without (lossless), only "
                  "draft forwards are saved. Draft trees grow along the guess without forwards of their own. "
                  "0 disables."},
    )
    draft_lookahead_max_cost: float | None = field(
        default=1.25,
        metadata={"help": "Draft model: the most a draft forward with lookahead guesses may cost, as a multiple of a "
                  "forward without them (over one token for a chain, over `tree_branching` frontier nodes for a "
                  "tree's deeper forwards). The draft's forward is timed at a few widths once per process "
                  "(`calibration.affordable_lookahead`), and lookahead feeds at most as many guess tokens as stay "
                  "within this cost: all of `draft_lookahead` where wider forwards are nearly free (bfloat16 with AMX), "
                  "few or none where each token costs more (float32 with AVX2). None: no limit."},
    )
    prefill_draft_confidence: float | None = field(
        default=None,
        metadata={"help": "Draft the first tokens before the prompt's prefill and verify them in the prefill's own "
                  "forward, as transformers' assisted generation does: one target forward fewer per call (worth most "
                  "where a target forward is dear, e.g. offloaded). The draft proposes up to the step's cap and stops "
                  "after the first token whose draft probability is below this value. Needs a draft model (prompt "
                  "lookup alone has no probabilities and ignores it). None: the prefill verifies nothing, and the "
                  "policy decides from the first step on."},
    )
    draft_vocab_size: int | None = field(
        default=65536,
        metadata={"help": "Draft model: propose only among the first this many token ids (a BPE vocabulary lists its "
                  "tokens roughly from most to least frequent), the batch's prompt tokens and the EOS ids, so the "
                  "draft's output layer reads that many rows instead of the whole vocabulary. The target still "
                  "decides every token (lossless); only acceptance can drop. None: the whole vocabulary (also used "
                  "when the draft's logits are not a plain linear map of its last hidden state)."},
    )
    sampling: str = field(
        default="standard",
        metadata={"help": "How sampled tokens are drawn (`do_sample=True`): 'standard' from the random generator, with "
                  "speculative rejection sampling; 'coupled' as the argmax of the processed scores plus Gumbel noise "
                  "that a keyed hash computes from `seed`, the row's prompt, its index among the call's rows with that "
                  "prompt, and the token's key (`coupling_keys`; `hf_dynspec.coupling`). Either way each token is "
                  "exactly a sample of the target's distribution. Coupled samples do not depend on the proposer, the "
                  "draft lengths or the batch, and a prompt sampled again with the same seed after a small update of "
                  "the model repeats most of what it sampled before (see `reuse_rollouts`). Greedy decoding ignores it."},
    )
    seed: int | None = field(
        default=None,
        metadata={"help": "Coupled sampling: the seed of every row's noise. Calls with the same seed, prompt and index "
                  "sample the same tokens from the same distributions; a new seed removes the coupling. None: each "
                  "call draws its seed from torch's random generator (so `transformers.set_seed` reproduces a run and "
                  "two calls sample independently), except with `reuse_rollouts`, which needs the same seed every "
                  "epoch and uses `coupling.REUSE_SEED` (0), saying so once."},
    )
    coupling_keys: str = field(
        default="context",
        metadata={"help": "Coupled sampling: what keys a token's noise besides the row's stream. 'context': the "
                  "last 4 tokens before it and how often they occurred before in the response (never a key twice in "
                  "a row), so a row whose later sample inserted or dropped a token re-joins the earlier sample's "
                  "noise, and what it sampled there, 4 tokens later; 'position': the token's position in the "
                  "response. Both sample exactly the target's distribution; they differ in what a later sample "
                  "repeats (docs/rollouts.md)."},
    )
    draft_head: str | None = field(
        default=None,
        metadata={"help": "A draft head to draft with when the call passes no `assistant_model`: a folder or Hub id "
                  "of an EAGLE-3 head (the `speculators` or the SpecForge format, `hf_dynspec.eagle3`), or 'mtp' for "
                  "the target's own MTP layers (`hf_dynspec.mtp`). Loaded once per target and kept with it, so a "
                  "generation config or a Hub folder can name the head its model drafts with."},
    )
    reuse_rollouts: bool = field(
        default=False,
        metadata={"help": "Keep each finished row's tokens in a rollout cache of the target model (per stream: seed, "
                  "prompt, index), and let a later call's row with the same stream propose that earlier sample's "
                  "continuation from its own position, at no draft cost (`hf_dynspec.candidates.rollout`): an RL "
                  "epoch reuses what the previous one sampled, exactly. Needs `sampling='coupled'`; greedy calls "
                  "reuse earlier greedy answers. `hf_dynspec.clear_rollouts(model)` empties the cache."},
    )
    rollout_cache_samples: int | None = field(
        default=None,
        metadata={"help": "Rollout cache: finished samples kept, at most (least recently stored out first); None: as "
                  "many as `rollout_cache_tokens` holds, so an epoch of any number of prompts is kept whole."},
    )
    rollout_cache_tokens: int = field(
        default=1 << 24,
        metadata={"help": "Rollout cache: tokens of those samples kept, at most (least recently stored out first, so "
                  "the oldest epoch goes first); 4 MiB per million tokens."},
    )
    narrow_linear: str = field(
        default="auto",
        metadata={"help": "Linear layers of forwards over a few rows (verify forwards, draft lookahead, trees): 'auto' "
                  "computes each row count the fastest way measured (weight-first, `(W @ x.T).T`, or as a product over "
                  "a wider row count), timed once per process and weight shape on weights read from memory, as a "
                  "forward reads them (float32 on a CPU; see `hf_dynspec.kernels`); 'on' always computes weight-first "
                  "for float32 weights, 'off' changes nothing. One-row forwards are never changed."},
    )
    packed_verify: bool = field(
        default=True,
        metadata={"help": "Verify forwards feed the target only the tokens rows propose, packed into one sequence, so "
                  "its linear layers compute `sum(1 + k_i)` tokens instead of every row padded to the longest draft "
                  "(`hf_dynspec.packing`; models with SDPA attention and no sliding windows). False pads."},
    )
    fold_attention: bool = field(
        default=True,
        metadata={"help": "The loop's forwards of models with grouped-query SDPA attention fold each key/value head's "
                  "query heads into the query length, instead of copying keys and values per query head as "
                  "transformers does for blocks of several tokens (on a CPU, blocks of up to 128 tokens; "
                  "`hf_dynspec.attention`). False leaves attention to transformers."},
    )
    compact_min_holes: int = field(
        default=32,
        metadata={"help": "KV-cache compaction runs only when at least this many columns could be freed."},
    )
    compact_hole_fraction: float = field(
        default=0.25,
        metadata={"help": "KV-cache compaction runs when freeable columns exceed this fraction of the cache length."},
    )
    collect_step_stats: bool = field(
        default=True,
        metadata={"help": "Record one `StepRecord` per step in `dynspec_stats` (totals are always kept)."},
    )

    def __post_init__(self) -> None:
        self._check_int("num_speculative_tokens", minimum=0)
        self._check_int("tree_node_budget", minimum=0)
        self._check_int("tree_branching", minimum=1)
        self._check_choice("tree_stop_judges", TREE_STOP_JUDGES)
        self._check_int("prompt_lookup_max_ngram", minimum=1)
        self._check_int("prompt_lookup_min_ngram", minimum=1)
        self._check_int("prompt_lookup_max_tokens", minimum=1)
        self._check_int("draft_lookahead", minimum=0)
        self._check_int("suffix_max_depth", minimum=1)
        self._check_int("suffix_cache_outputs", minimum=1)
        self._check_int("suffix_cache_tokens", minimum=1)
        self._check_number("suffix_min_token_probability", 0.0, 1.0)
        self._check_number("suffix_spec_factor", 0.0, float("inf"))
        self._check_int("compact_min_holes", minimum=1)
        self._check_choice("sampling", SAMPLERS)
        self._check_choice("coupling_keys", KEYINGS)
        if self.seed is not None:
            self._check_int("seed", minimum=0)
        if self.rollout_cache_samples is not None:
            self._check_int("rollout_cache_samples", minimum=1)
        self._check_int("rollout_cache_tokens", minimum=1)
        if self.draft_head is not None and (not isinstance(self.draft_head, str) or not self.draft_head):
            raise ValueError(f"`draft_head` must be a folder, a Hub id or 'mtp'; got {self.draft_head!r}.")
        if not isinstance(self.reuse_rollouts, bool):
            raise ValueError(f"`reuse_rollouts` must be a bool, got {self.reuse_rollouts!r}.")
        if self.reuse_rollouts and self.sampling != "coupled":
            raise ValueError(
                "`reuse_rollouts=True` proposes earlier samples back, which a later sample repeats only when both were "
                "drawn with the same noise: set `sampling='coupled'` too (greedy calls then reuse earlier greedy "
                "answers)."
            )
        cost = self.draft_lookahead_max_cost
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float)) or not cost >= 1.0):
            raise ValueError(
                f"`draft_lookahead_max_cost` must be a number >= 1 (a multiple of a one-token draft forward) or None "
                f"(no limit), got {cost!r}."
            )
        floor = self.tree_min_node_probability
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= floor < 1.0:
            raise ValueError(
                f"`tree_min_node_probability` must be a number in [0, 1) (a draft path probability), got {floor!r}."
            )
        confidence = self.prefill_draft_confidence
        if confidence is not None and (
            isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 <= confidence <= 1.0
        ):
            raise ValueError(
                f"`prefill_draft_confidence` must be a draft probability in [0, 1] or None (off), got {confidence!r}."
            )
        if self.draft_vocab_size is not None:
            self._check_int("draft_vocab_size", minimum=1)
        if self.prompt_lookup_min_ngram > self.prompt_lookup_max_ngram:
            raise ValueError(
                f"`prompt_lookup_min_ngram` ({self.prompt_lookup_min_ngram}) must not exceed "
                f"`prompt_lookup_max_ngram` ({self.prompt_lookup_max_ngram})."
            )
        fraction = self.compact_hole_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"`compact_hole_fraction` must be a number in (0, 1], got {self.compact_hole_fraction!r}.")
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError(f"`policy` must be a policy name such as 'static', got {self.policy!r}.")
        self._check_choice("narrow_linear", NARROW_LINEAR)
        self._check_choice("proposer", PROPOSERS)
        if not isinstance(self.policy_options, dict):
            raise ValueError(f"`policy_options` must be a dict, got {type(self.policy_options).__name__}.")
        for name in ("packed_verify", "fold_attention", "collect_step_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")

    def _check_int(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")

    def _check_number(self, name: str, low: float, high: float) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ValueError(f"`{name}` must be a number in [{low}, {high}], got {value!r}.")

    def _check_choice(self, name: str, choices: tuple) -> None:
        value = getattr(self, name)
        if value not in choices:
            raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")

    # ---- serialisation -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DynSpecConfig:
        """Build from a dict; unknown keys raise `ValueError` listing the valid ones."""
        if not isinstance(data, dict):
            raise ValueError(f"A DynSpecConfig is built from a dict, got {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown DynSpecConfig key(s) {unknown}; valid keys are {sorted(known)}.")
        return cls(**data)

    @classmethod
    def from_json_file(cls, path: str | Path) -> DynSpecConfig:
        """Build from a JSON file holding the dict form."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def coerce(cls, value: DynSpecConfig | dict[str, Any] | str | Path | None) -> DynSpecConfig:
        """Accept a config, a dict, a JSON file path or `None` (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, (str, Path)):
            if not Path(value).is_file():
                raise ValueError(
                    f"`dynspec_config={str(value)!r}` is read as the path of a JSON file, and there is no such file. To "
                    f"choose a policy, pass DynSpecConfig(policy=...) or a dict such as {{'policy': 'static'}}."
                )
            return cls.from_json_file(value)
        raise ValueError(
            f"`dynspec_config` must be a DynSpecConfig, a dict or a JSON file path, got {type(value).__name__}."
        )

    def to_generation_config(self, generation_config: GenerationConfig) -> GenerationConfig:
        """Store these settings in `generation_config` under the `dynspec` key and return it.

        The settings are kept as a plain dict, so `generation_config.save_pretrained` (and a model's
        `save_pretrained`) write them to `generation_config.json` and `GenerationConfig.from_pretrained` reads them
        back; [`from_generation_config`][hf_dynspec.config.DynSpecConfig.from_generation_config] turns them into a
        `DynSpecConfig` again.

        Example:

        ```python
        >>> from transformers import GenerationConfig
        >>> generation_config = DynSpecConfig(num_speculative_tokens=6).to_generation_config(GenerationConfig())
        >>> generation_config.dynspec["num_speculative_tokens"]
        6
        ```
        """
        from transformers import GenerationConfig

        if not isinstance(generation_config, GenerationConfig):
            raise ValueError(
                f"`to_generation_config` expects a transformers GenerationConfig, got {type(generation_config).__name__}; "
                "pass `model.generation_config` or a `GenerationConfig(...)`."
            )
        setattr(generation_config, GENERATION_CONFIG_KEY, self.to_dict())
        # A config marked as derived from the model config drops every extra attribute when it is loaded again;
        # once it carries our settings it is the model's own generation config (transformers' Seq2SeqTrainer does
        # the same when it edits a model's generation config).
        generation_config._from_model_config = False
        return generation_config

    @classmethod
    def from_generation_config(cls, generation_config: GenerationConfig | None) -> DynSpecConfig | None:
        """The settings stored under the `dynspec` key of `generation_config`, or `None` when there are none.

        Missing fields take their defaults; an unknown field or an invalid value raises `ValueError` naming the
        generation config key, the field and the valid choices.
        """
        value = getattr(generation_config, GENERATION_CONFIG_KEY, None) if generation_config is not None else None
        if value is None:
            return None
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"The generation config's `{GENERATION_CONFIG_KEY}` entry must be a dict of DynSpecConfig settings, "
                f"got {type(value).__name__}; write it with `DynSpecConfig(...).to_generation_config(...)`."
            )
        try:
            return cls.from_dict(value)
        except ValueError as error:
            raise ValueError(
                f"Invalid `{GENERATION_CONFIG_KEY}` entry in the generation config: {error} "
                f"Fix or remove that entry of `generation_config.json`."
            ) from error

    @classmethod
    def help_texts(cls) -> dict[str, str]:
        """The help text of every field, for documentation and command lines."""
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}
