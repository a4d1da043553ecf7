"""Benchmark methods by name: plain `generate`, transformers' assisted generation, and the speculative loop.

| name | what runs |
| --- | --- |
| `plain` | `generate` without a proposer, batched |
| `hf-assisted` | transformers' assisted generation with its defaults (rows one at a time) |
| `hf-heuristic` | the same with `num_assistant_tokens_schedule="heuristic"` |
| `hf-prompt-lookup[:N]` | transformers' prompt lookup, `prompt_lookup_num_tokens=N` (default 10) |
| `dynspec-nospec` | `hf_dynspec.generate` proposing nothing: the loop without speculation (rows leave as they finish) |
| `dynspec-<policy>[:K]` | `hf_dynspec.generate` with the draft model and policy `<policy>` (at most K draft tokens) |
| `dynspec-prompt-lookup[:N]` | `hf_dynspec.generate` with the model-free prompt-lookup proposer, N tokens |
| `dynspec-draft[:K]` | `goodput` with the draft model alone (`proposer="draft"`: the default before copies joined it) |
| `dynspec-hybrid[:K]` | `goodput` with the hybrid proposer: per row and step, prompt lookup or the draft model |
| `dynspec-tree[:N[:D]]` | `goodput` with draft-model token trees of at most N nodes per row (default 12), D deep (default 4) |
| `dynspec-tree-lookup[:N]` | `goodput` with prompt-lookup tries of at most N nodes per row (default 10) |
| `dynspec-suffix[:N]` | `goodput` with the suffix proposer (suffix trees, no draft model), at most N tokens per row and step (default 10) |
| `dynspec-head[:K]` | the default config with a draft head instead of the draft model: `policy_options["head"]["draft_head"]` names it (an EAGLE-3 folder or Hub id, or `mtp`) |

`<policy>` is any name in `hf_dynspec.policies.POLICIES` (`table` is short for `batch_table`); its options come from
`policy_options[<policy>]`. A tag runs one policy with two sets of options side by side: `dynspec-goodput@profile`
takes its options from `policy_options["goodput@profile"]` (`dynspec-hybrid@x` from `policy_options["hybrid@x"]`,
`dynspec-tree@x:N:D` from `policy_options["tree@x"]`, `dynspec-nospec@x`'s `DynSpecConfig` fields from
`policy_options["nospec@x"]`).
Options named like a `DynSpecConfig` field (`draft_lookahead`, `prompt_lookup_max_tokens`, ...) set that field of
the method's config instead: `goodput@stepwise.draft_lookahead=0` drafts token by token.

Any method that uses the draft model may end in `/<variant>` to run with a variant of the bench's draft instead
(`fp32`, `bf16`, `8bit`, `4bit`, see `models.VARIANTS`): `dynspec-goodput/4bit` and `dynspec-goodput/fp32` compare a
4-bit and a float32 draft in one run, on the same prompts; where a modifier brings the draft, the variant follows it
(`dynspec-suffix+draft/4bit`).

A `dynspec-suffix` method may end in `+draft` (per row and step, the suffix proposal or the draft model, as the policy
decides), in `+warm` (before each timed run, the same prompts run once untimed with another seed, as an RL epoch
before: the timed run proposes from those outputs too) and in `+foreign` (before each timed run, another task's text
fills the suffix cache as earlier outputs: what a cache full of unrelated text costs). Otherwise every run starts from
an empty suffix cache.

A `plain` or `hf-*` method may end in `+narrow`, `+rowmajor` or both (`hf-assisted+narrow+rowmajor`) to run with the
kernels the speculative loop uses (`kernels.NarrowLinear`, `kernels.row_major_output`), so that a baseline is not
slower for a reason that has nothing to do with speculation.

A `dynspec-*` method that uses the draft model may end in `+text` (`dynspec-goodput+text`) to pass the target's
tokenizer as both `tokenizer` and `assistant_tokenizer`: every step then goes through text, as with a draft that has
another tokenizer (`candidates.translated_draft`), and the bench measures what that path costs on a pair that shares a
tokenizer. (Transformers' own assisted generation refuses `assistant_tokenizer` when the two vocabularies have the
same size, so `hf-*` methods cannot take `+text`.)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..config import DynSpecConfig
from ..coupling import REUSE_SEED

POLICY_ALIASES = {"table": "batch_table"}
"""Short method names for policies (`dynspec-table` runs the `batch_table` policy)."""

NARROW = "narrow"
"""The `+narrow` method modifier."""
ROW_MAJOR = "rowmajor"
"""The `+rowmajor` method modifier."""
TEXT = "text"
"""The `+text` method modifier."""
DRAFT = "draft"
"""The `+draft` modifier of `dynspec-suffix`: the suffix proposal or the draft model, per row and step."""
WARM = "warm"
"""The `+warm` modifier of `dynspec-suffix`: each timed run follows an untimed one over the same prompts."""
FOREIGN = "foreign"
"""The `+foreign` modifier of `dynspec-suffix`: each timed run starts from a suffix cache holding another task's text."""
SUFFIX_MODIFIERS = (DRAFT, WARM, FOREIGN)
MODIFIERS = (NARROW, ROW_MAJOR, TEXT, *SUFFIX_MODIFIERS)
"""What may follow a method's name after `+` (several: `hf-assisted+narrow+rowmajor`): the kernels the speculative
loop runs with, so that a baseline can have them too (`plain` and `hf-*` only), and drafting through text."""
REUSE = "dynspec-reuse"
"""Coupled sampling with the rollout cache (`+draft`: beside the draft model); `:N` caps its tokens a step."""
NO_SPECULATION = "dynspec-nospec"
HEAD = "dynspec-head"
"""Drafting with a draft head named in the method's options (`DynSpecConfig.draft_head`)."""
"""The loop without speculation: what dropping finished rows alone gives, against which speculation is measured."""
DEFAULT_LOOKUP_TOKENS = 10
DEFAULT_TREE_NODES = 12
DEFAULT_TRIE_NODES = 10
TREE_BRANCHING = 2


@dataclass(frozen=True)
class Method:
    """One way of generating; `kind` says which code path runs it."""

    name: str
    kind: Literal["plain", "hf", "dynspec"]
    uses_draft: bool = False
    generate_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    assistant_settings: dict[str, Any] = field(default_factory=dict, hash=False)
    """Attributes set on the draft model's `generation_config` while this method runs (transformers reads them there)."""
    dynspec_config: DynSpecConfig | None = field(default=None, hash=False)
    draft_variant: str | None = None
    """A variant of the bench's draft to run with (`models.VARIANTS`), or None for the draft as loaded."""
    narrow: bool = False
    """`plain` and `hf-*` methods: run `generate` inside `kernels.NarrowLinear` (the `+narrow` suffix)."""
    row_major: bool = False
    """`plain` and `hf-*` methods: run `generate` inside `kernels.row_major_output` (the `+rowmajor` suffix)."""
    through_text: bool = False
    """`dynspec-*` methods with a draft: pass the target's tokenizer as `tokenizer` and `assistant_tokenizer` (the `+text`
    suffix), so the draft reads and writes text as a draft with another tokenizer does."""
    warm: bool = False
    """`dynspec-suffix` methods: each timed run follows an untimed run over the same prompts (the `+warm` suffix)."""
    foreign: bool = False
    """`dynspec-suffix` methods: each timed run starts from a cache of another task's text (the `+foreign` suffix)."""

    @property
    def suffix(self) -> bool:
        """Whether the method proposes from suffix trees (whose cache the bench empties before each run)."""
        return self.dynspec_config is not None and self.dynspec_config.proposer == "suffix"

    @property
    def reuse(self) -> bool:
        """Whether the method proposes from the rollout cache (which the bench sets to the epoch before each run)."""
        return self.dynspec_config is not None and self.dynspec_config.reuse_rollouts

    @property
    def batched(self) -> bool:
        """False for transformers' assisted methods, which cannot batch: rows run one at a time."""
        return self.kind != "hf"


class MethodError(ValueError):
    """A method name or its options are invalid; the message lists what is accepted."""


def _count(name: str, argument: str | None, default: int) -> int:
    if argument is None:
        return default
    if not argument.isdigit() or int(argument) < 1:
        raise MethodError(f"In method {name!r} the number after ':' must be a positive integer, got {argument!r}.")
    return int(argument)


def parse_method(name: str, policy_options: dict[str, dict[str, Any]] | None = None) -> Method:
    """The `Method` for `name` (see the module docstring for the accepted names)."""
    name = name.strip()
    head, slash, variant = name.rpartition("/")
    if slash and "+" in head and "+" not in variant:  # the variant after the modifiers: dynspec-suffix+draft/4bit
        return _with_variant(name, parse_method(head, policy_options), variant)
    stem, plus, modifiers = name.partition("+")
    if plus:
        return _with_modifiers(name, parse_method(stem, policy_options), modifiers.split("+"))
    stem, slash, variant = name.partition("/")
    if not slash:
        return _parse_stem(name, policy_options)
    return _with_variant(name, _parse_stem(stem, policy_options), variant)


def _with_variant(name: str, method: Method, variant: str) -> Method:
    """`method` drafting with the bench draft's `variant` (`/4bit`)."""
    from .models import VARIANTS

    if variant not in VARIANTS:
        raise MethodError(f"In method {name!r} the draft variant after '/' must be one of {sorted(VARIANTS)}.")
    if not method.uses_draft:
        raise MethodError(
            f"Method {method.name!r} uses no draft model, so {name!r} has no draft to vary; drop '/{variant}'."
        )
    return dataclasses.replace(method, name=name, draft_variant=variant)


def _with_modifiers(name: str, method: Method, modifiers: list[str]) -> Method:
    """`method` run with the loop's kernels: inside `kernels.NarrowLinear` (`+narrow`), with its output layers fed
    row-major inputs (`+rowmajor`, `kernels.row_major_output`); drafting through text (`+text`, `dynspec-*`); or
    suffix speculation with the draft model (`+draft`), after an untimed run (`+warm`) or over another task's text
    (`+foreign`)."""
    unknown = [m for m in modifiers if m not in MODIFIERS]
    if unknown:
        raise MethodError(f"In method {name!r} the modifiers after '+' may only be {list(MODIFIERS)}; got {unknown}.")
    suffix_modifiers = [m for m in modifiers if m in SUFFIX_MODIFIERS]
    if suffix_modifiers and not (method.suffix or (method.reuse and suffix_modifiers == [DRAFT])):
        raise MethodError(f"Method {name!r}: '+{'+'.join(suffix_modifiers)}' applies to dynspec-suffix methods only.")
    method = dataclasses.replace(
        method, uses_draft=method.uses_draft or DRAFT in modifiers, warm=WARM in modifiers, foreign=FOREIGN in modifiers
    )
    modifiers = [m for m in modifiers if m not in SUFFIX_MODIFIERS]
    kernels = [m for m in modifiers if m != TEXT]
    if method.kind == "dynspec" and kernels:
        raise MethodError(
            f"Method {name!r}: dynspec methods always feed output layers row-major inputs and choose narrow products "
            f"with the option narrow_linear (e.g. --policy-option goodput@stock.narrow_linear=off); drop "
            f"'+{'+'.join(kernels)}'."
        )
    if TEXT in modifiers and not (method.kind == "dynspec" and method.uses_draft):
        raise MethodError(
            f"Method {name!r}: '+{TEXT}' re-encodes a draft model's text in the speculative loop, so it applies to "
            f"dynspec methods with a draft model only (transformers' assisted generation refuses a second tokenizer "
            f"when both vocabularies have the same size); drop '+{TEXT}'."
        )
    return dataclasses.replace(method, name=name, narrow=NARROW in modifiers or method.narrow,
                               row_major=ROW_MAJOR in modifiers or method.row_major,
                               through_text=TEXT in modifiers or method.through_text)


def _parse_stem(name: str, policy_options: dict[str, dict[str, Any]] | None) -> Method:
    base, _, argument = name.strip().partition(":")
    argument = argument or None
    if base == "plain" and argument is None:
        return Method(name, "plain")
    if base == "hf-assisted" and argument is None:
        return Method(name, "hf", uses_draft=True)
    if base == "hf-heuristic" and argument is None:
        return Method(name, "hf", uses_draft=True, assistant_settings={"num_assistant_tokens_schedule": "heuristic"})
    if base == "hf-prompt-lookup":
        tokens = _count(name, argument, DEFAULT_LOOKUP_TOKENS)
        return Method(name, "hf", generate_kwargs={"prompt_lookup_num_tokens": tokens})
    if base.partition("@")[0] == NO_SPECULATION and argument is None:  # a proposer never asked: k = 0 every step
        tag = base.partition("@")[2]
        _, fields = _config_fields(dict((policy_options or {}).get(f"nospec@{tag}" if tag else "nospec", {})))
        config = DynSpecConfig(num_speculative_tokens=0, policy="static", **fields)
        return Method(name, "dynspec", generate_kwargs={"prompt_lookup_num_tokens": 1}, dynspec_config=config)
    if base == "dynspec-prompt-lookup":
        tokens = _count(name, argument, DEFAULT_LOOKUP_TOKENS)
        config = DynSpecConfig(num_speculative_tokens=tokens, policy="static")
        return Method(name, "dynspec", generate_kwargs={"prompt_lookup_num_tokens": tokens}, dynspec_config=config)
    if base.partition("@")[0] in ("dynspec-hybrid", "dynspec-draft"):
        proposer, _, tag = base[len("dynspec-") :].partition("@")
        options, fields = _config_fields(dict((policy_options or {}).get(f"{proposer}@{tag}" if tag else proposer, {})))
        settings = {"policy": "goodput", "proposer": proposer, "policy_options": options, **fields}
        if argument is not None:
            settings["num_speculative_tokens"] = _count(name, argument, 0)
        return Method(name, "dynspec", uses_draft=True, dynspec_config=DynSpecConfig(**settings))
    if base.partition("@")[0] == "dynspec-suffix":
        tag = base.partition("@")[2]
        options, fields = _config_fields(dict((policy_options or {}).get(f"suffix@{tag}" if tag else "suffix", {})))
        settings = {"policy": "goodput", "proposer": "suffix", "policy_options": options, **fields}
        settings["prompt_lookup_max_tokens"] = _count(name, argument, fields.get("prompt_lookup_max_tokens", DEFAULT_LOOKUP_TOKENS))
        return Method(name, "dynspec", dynspec_config=DynSpecConfig(**settings))
    if base.partition("@")[0] == REUSE:
        tag = base.partition("@")[2]
        options, fields = _config_fields(dict((policy_options or {}).get(f"reuse@{tag}" if tag else "reuse", {})))
        settings = {"policy": "goodput", "policy_options": options, "sampling": "coupled", "reuse_rollouts": True,
                    "seed": REUSE_SEED, **fields}
        settings["prompt_lookup_max_tokens"] = _count(name, argument, fields.get("prompt_lookup_max_tokens", DEFAULT_LOOKUP_TOKENS))
        return Method(name, "dynspec", dynspec_config=DynSpecConfig(**settings))
    if base.partition("@")[0] in ("dynspec-tree", "dynspec-tree-lookup"):
        return _tree_method(name, base, argument, policy_options)
    if base.partition("@")[0] == HEAD:
        return _head_method(name, base, argument, policy_options)
    if base.startswith("dynspec-"):
        policy, _, tag = base[len("dynspec-") :].partition("@")
        policy = POLICY_ALIASES.get(policy, policy)
        _check_registered(name, policy)
        options, fields = _config_fields(dict((policy_options or {}).get(f"{policy}@{tag}" if tag else policy, {})))
        settings: dict[str, Any] = {"policy": policy, "policy_options": options, **fields}
        if argument is not None:
            settings["num_speculative_tokens"] = _count(name, argument, 0)
        elif policy == "batch_table" and isinstance(options.get("num_speculative_tokens"), int):
            settings["num_speculative_tokens"] = options["num_speculative_tokens"]  # the table's own maximum
        return Method(name, "dynspec", uses_draft=True, dynspec_config=DynSpecConfig(**settings))
    raise MethodError(
        f"Unknown method {name!r}. Use plain, hf-assisted, hf-heuristic, hf-prompt-lookup[:N], {NO_SPECULATION}, "
        "dynspec-prompt-lookup[:N], dynspec-draft[:K], dynspec-hybrid[:K], dynspec-tree[:N[:D]], dynspec-tree-lookup[:N], "
        "dynspec-suffix[:N][+draft][+warm][+foreign], dynspec-reuse[:N][+draft], dynspec-head[:K] or "
        "dynspec-<policy>[:K] with a policy from "
        "hf_dynspec.policies.POLICIES."
    )


def _head_method(name: str, base: str, argument: str | None, policy_options: dict[str, dict[str, Any]] | None) -> Method:
    """`dynspec-head[@tag][:K]`: the default config drafting with the head `policy_options["head@tag"]` names."""
    tag = base.partition("@")[2]
    key = f"head@{tag}" if tag else "head"
    options, fields = _config_fields(dict((policy_options or {}).get(key, {})))
    if not fields.get("draft_head"):
        raise MethodError(f"{name} drafts with a head: name it with --policy-option {key}.draft_head=<folder, Hub id or mtp>.")
    settings = {"policy_options": options, **fields}
    if argument is not None:
        settings["num_speculative_tokens"] = _count(name, argument, 0)
    return Method(name, "dynspec", dynspec_config=DynSpecConfig(**settings))


def _tree_method(
    name: str, base: str, argument: str | None, policy_options: dict[str, dict[str, Any]] | None
) -> Method:
    """`goodput` with token trees: draft-model trees (`dynspec-tree`) or prompt-lookup tries (`dynspec-tree-lookup`);
    a tag (`dynspec-tree@x`) takes its options from `policy_options["tree@x"]`."""
    options, fields = _config_fields(dict((policy_options or {}).get(base[len("dynspec-") :], {})))
    base = base.partition("@")[0]
    if base == "dynspec-tree":
        nodes_text, _, depth_text = (argument or "").partition(":")
        nodes = _count(name, nodes_text or None, DEFAULT_TREE_NODES)
        depth = _count(name, depth_text or None, DynSpecConfig().num_speculative_tokens)
        config = DynSpecConfig(**{"tree_branching": TREE_BRANCHING, **fields}, num_speculative_tokens=depth,
                               policy="goodput", policy_options=options, tree_node_budget=nodes)
        return Method(name, "dynspec", uses_draft=True, dynspec_config=config)
    nodes = _count(name, argument, DEFAULT_TRIE_NODES)
    config = DynSpecConfig(**fields, num_speculative_tokens=DEFAULT_LOOKUP_TOKENS, policy="goodput",
                           policy_options=options, tree_node_budget=nodes)
    return Method(name, "dynspec", generate_kwargs={"prompt_lookup_num_tokens": DEFAULT_LOOKUP_TOKENS},
                  dynspec_config=config)


def parse_methods(
    names: str | list[str], policy_options: dict[str, dict[str, Any]] | None = None, require_plain: bool = True
) -> list[Method]:
    """Methods from a comma-separated list; `plain` must be among them (every greedy output is compared with it)
    unless `require_plain` is false (sampled runs, whose outputs differ anyway)."""
    items = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    methods = [parse_method(n, policy_options) for n in items if n]
    seen = [m.name for m in methods]
    if len(set(seen)) != len(seen):
        raise MethodError(f"Methods are listed twice in {seen}; give each once.")
    if require_plain and "plain" not in seen:
        raise MethodError(f"The methods {seen} must include 'plain': every method's output is compared with it.")
    return methods


def _check_registered(name: str, policy: str) -> None:
    """Raise `MethodError` when method `name` names a policy that is not registered."""
    from ..policies import POLICIES

    if policy not in POLICIES:
        raise MethodError(
            f"Method {name!r} needs policy {policy!r}, which is not registered; registered policies: {sorted(POLICIES)}."
        )


def parse_policy_options(
    items: list[str] | None, base: dict[str, dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """`["batch_table.table=t.json", "goodput@p.window=5"]` -> `{"batch_table": {"table": "t.json"}, "goodput@p": ...}`.

    Values are read as JSON when they parse (numbers, booleans, lists), else kept as strings. `base` (e.g. a
    scenario's options) is copied, never changed, and the items win over it option by option.
    """
    options: dict[str, dict[str, Any]] = {name: dict(values) for name, values in (base or {}).items()}
    for item in items or []:
        key, equals, value = item.partition("=")
        policy, dot, option = key.partition(".")
        if not (equals and dot and policy and option):
            raise MethodError(f"Policy options look like POLICY.OPTION=VALUE (e.g. goodput.window=8), got {item!r}.")
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        name, at, tag = policy.partition("@")
        options.setdefault(POLICY_ALIASES.get(name, name) + at + tag, {})[option] = parsed
    return options


def table_policy_options(path: str | Path, acceptance: float = 0.7, num_speculative_tokens: int = 4) -> dict[str, Any]:
    """`batch_table` policy options from a JSON file: a vLLM speculative config with a batch-size table, or a
    calibration profile (`hf-dynspec calibrate`), from which the table is derived for the given acceptance rate."""
    from ..calibration import vllm_speculative_config
    from ..cost_models import Profile
    from ..policies.batch_table import SCHEDULE_KEY

    path = Path(path)
    if not path.is_file():
        raise MethodError(f"Table file {str(path)!r} does not exist; give a vLLM speculative config or a profile.")
    data = json.loads(path.read_text())
    if isinstance(data, dict) and SCHEDULE_KEY in data:
        return data
    try:
        profile = Profile.from_dict(data)
    except ValueError as error:
        raise MethodError(
            f"{path} is neither a vLLM speculative config (with {SCHEDULE_KEY!r}) nor a calibration profile: {error}"
        ) from error
    return vllm_speculative_config(profile, acceptance, num_speculative_tokens, max_batch_size=256)


def _config_fields(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a method's options into policy options and `DynSpecConfig` fields (all but the policy's own and
    `num_speculative_tokens`, which the method's `:K` sets and `batch_table` takes as an option)."""
    names = {f.name for f in dataclasses.fields(DynSpecConfig)} - {"policy", "policy_options", "num_speculative_tokens"}
    fields = {key: options.pop(key) for key in list(options) if key in names}
    return options, fields
