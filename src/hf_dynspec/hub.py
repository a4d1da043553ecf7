"""Export hf_dynspec as a transformers `custom_generate` folder (a Hub repository or a local directory).

`export_hub(out_dir, config, model)` writes:

- `custom_generate/generate.py`: `generate(model, **kwargs)`, which transformers calls with every other `generate`
  argument as a keyword; it runs [`generate_with_settings`][hf_dynspec.hub.generate_with_settings] with the settings
  baked into the file;
- `custom_generate/requirements.txt`: `hf-dynspec>=<this version>` (transformers checks it before running the code);
- `README.md`: the card of a custom generation method, its argument table built from `DynSpecConfig`'s fields;
- optionally a model and its tokenizer (`save_pretrained`), so the folder is also a model repository.

The settings are written into `generate.py` itself rather than into a file next to it: transformers copies only
`generate.py` (and the Python files it imports relatively) into its module cache before running it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import re
from pathlib import Path
from typing import Any

from .config import GENERATION_CONFIG_KEY, DynSpecConfig

CUSTOM_GENERATE_DIR = "custom_generate"
DISTRIBUTION_NAME = "hf-dynspec"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class HubExportError(ValueError):
    """The export cannot proceed; the message says what was wrong and what to do."""


@dataclasses.dataclass
class ExportResult:
    """What `export_hub` wrote."""

    out_dir: Path
    files: list[Path]
    model_name: str | None = None
    tokenizer_saved: bool = False


# ---- the function the exported generate.py calls -----------------------------------------------------------------
def generate_with_settings(model: Any, settings: dict[str, Any] | None, **kwargs: Any) -> Any:
    """Run [`hf_dynspec.generate`][hf_dynspec.generate] with an exported folder's settings as the fallback.

    Which settings apply, first match wins: the call's `dynspec_config`; the `dynspec` entry of the call's
    `generation_config` or of `model.generation_config`; `settings` (baked in by `hf-dynspec export-hub --config`);
    `DynSpecConfig()` defaults.

    Args:
        model: the target model (`PreTrainedModel`).
        settings: the dict form of a `DynSpecConfig`, or `None` for none.
        **kwargs: every argument of `model.generate` (`input_ids`, `assistant_model`, `generation_config`,
            `logits_processor`, `stopping_criteria`, `streamer`, `max_new_tokens`, `dynspec_config`, ...).
    """
    import hf_dynspec

    if settings is not None and kwargs.get("dynspec_config") is None and not _has_model_settings(model, kwargs):
        kwargs["dynspec_config"] = DynSpecConfig.from_dict(settings)
    return hf_dynspec.generate(model, **kwargs)


def _has_model_settings(model: Any, kwargs: dict[str, Any]) -> bool:
    """True when the call's or the model's generation config carries a `dynspec` entry."""
    configs = (kwargs.get("generation_config"), getattr(model, "generation_config", None))
    return any(getattr(c, GENERATION_CONFIG_KEY, None) is not None for c in configs if c is not None)


# ---- export ------------------------------------------------------------------------------------------------------
def export_hub(
    out_dir: str | Path,
    config: DynSpecConfig | None = None,
    model: str | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write a `custom_generate` folder to `out_dir` (see the module docstring for its contents).

    Args:
        out_dir: the folder to create; it must not exist or be empty, unless `overwrite` is set.
        config: settings baked into `generate.py` (and into the model's `generation_config.json` when `model` is
            given); `None` leaves the choice to the caller and the model's generation config.
        model: a local model directory, a local `.gguf` file or a name of the evaluation registry; its model and
            tokenizer are saved into `out_dir`.
        overwrite: write into a non-empty `out_dir`, replacing files of the same names.
    """
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    code_dir = out / CUSTOM_GENERATE_DIR
    code_dir.mkdir(parents=True, exist_ok=True)
    result = ExportResult(out_dir=out, files=[])
    if model is not None:
        result.model_name, result.tokenizer_saved = save_model(model, out, config)
    _write(result, code_dir / "generate.py", render_generate_py(config))
    _write(result, code_dir / "requirements.txt", render_requirements())
    _write(result, out / "README.md", render_readme(config, result.model_name))
    return result


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise HubExportError(f"Output path {str(out)!r} is a file; give a directory to create.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise HubExportError(
            f"Output directory {str(out)!r} is not empty; choose a new directory or pass --overwrite to write into it."
        )


def _write(result: ExportResult, path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    result.files.append(path)


def requirement_line() -> str:
    """`hf-dynspec>=X.Y.Z`: the installed release, which the exported code and settings format need."""
    installed = importlib.metadata.version(DISTRIBUTION_NAME)
    release = re.match(r"\d+(\.\d+)*", installed)  # transformers' check accepts digits and dots only
    if release is None:
        raise HubExportError(f"Cannot read a release number from the installed {DISTRIBUTION_NAME} {installed!r}.")
    return f"{DISTRIBUTION_NAME}>={release.group(0)}"


def render_requirements() -> str:
    """Contents of `custom_generate/requirements.txt` (transformers accepts one comparison per line)."""
    return requirement_line() + "\n"


def render_generate_py(config: DynSpecConfig | None) -> str:
    """Contents of `custom_generate/generate.py` with `config` baked in as `SETTINGS`."""
    return GENERATE_PY_TEMPLATE.replace("{settings}", _python_literal(config))


def _python_literal(config: DynSpecConfig | None) -> str:
    """`config.to_dict()` as Python source, one setting per line (`None` without a config)."""
    if config is None:
        return "None"
    lines = [f"    {name!r}: {value!r}," for name, value in config.to_dict().items()]
    return "{\n" + "\n".join(lines) + "\n}"


GENERATE_PY_TEMPLATE = '''"""Batched, lossless, load-aware speculative decoding with hf_dynspec, as a transformers `custom_generate` method.

transformers calls `generate(model=..., **arguments)` with every other argument of `model.generate` as a keyword
(`input_ids`, `attention_mask`, `assistant_model`, `generation_config`, `logits_processor`, `stopping_criteria`,
`streamer`, `max_new_tokens`, `dynspec_config`, ...).
"""

from hf_dynspec.hub import generate_with_settings

# DynSpecConfig settings used when the call passes no `dynspec_config` and neither the call's nor the model's
# generation config has a `dynspec` entry. `None` means the DynSpecConfig defaults.
SETTINGS = {settings}


def generate(model, **kwargs):
    """Run hf_dynspec's batched speculative loop on `model` (the draft model is `assistant_model=`)."""
    return generate_with_settings(model, SETTINGS, **kwargs)
'''


# ---- the model -------------------------------------------------------------------------------------------------
def save_model(reference: str, out_dir: Path, config: DynSpecConfig | None) -> tuple[str, bool]:
    """Save the model (and its tokenizer, when it has one) named by `reference` into `out_dir`.

    Returns the model's display name and whether a tokenizer was saved. With `config`, the model's
    `generation_config.json` also carries the settings under the `dynspec` key.
    """
    from .evaluation.models import REGISTRY, load_model, load_tokenizer, resolve_model

    local = Path(reference).expanduser()
    if reference not in REGISTRY and not local.is_dir() and not (local.suffix == ".gguf" and local.is_file()):
        raise HubExportError(
            f"--model {reference!r} is neither a local model directory, a local .gguf file nor a registry name; "
            f"registry names are {sorted(REGISTRY)}."
        )
    location = resolve_model(reference)
    model = load_model(location)
    if config is not None:
        config.to_generation_config(model.generation_config)
    model.save_pretrained(out_dir)
    has_tokenizer = location.gguf_file is not None or any((local / name).is_file() for name in TOKENIZER_FILES)
    if has_tokenizer:
        load_tokenizer(location).save_pretrained(out_dir)
    name = reference if reference in REGISTRY else (local.name or reference)
    return name, has_tokenizer


# ---- the README --------------------------------------------------------------------------------------------------
def settings_table() -> str:
    """Markdown table of every `DynSpecConfig` field: name, type, default and help text."""
    rows = ["| Setting | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(DynSpecConfig):
        help_text = f.metadata.get("help", "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{_type_name(f)}` | `{_default(f)!r}` | {help_text} |")
    return "\n".join(rows)


def _type_name(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def render_readme(config: DynSpecConfig | None, model_name: str | None) -> str:
    """Contents of `README.md`: front matter with the `custom_generate` tag and the usual sections."""
    sections = [
        README_FRONT_MATTER,
        README_DESCRIPTION,
        _base_model_section(model_name),
        README_COMPATIBILITY,
        README_ARGUMENTS.replace("{settings_table}", settings_table()),
        _baked_settings_section(config),
        README_OUTPUT,
        README_TRUST,
        _example_section(model_name),
    ]
    return "\n".join(section.strip() + "\n" for section in sections)


def _base_model_section(model_name: str | None) -> str:
    if model_name is None:
        return (
            "## Base model\n\nThis folder holds no model: the method runs on any causal language model of "
            "`transformers`, given as the model whose `generate` you call."
        )
    return (
        f"## Base model\n\nThis folder also holds `{model_name}` (model and tokenizer saved with `save_pretrained`). "
        "Loading it with `trust_remote_code=True` makes its plain `generate` use this method, because transformers "
        "picks up `custom_generate/generate.py` from the model's own folder."
    )


def _baked_settings_section(config: DynSpecConfig | None) -> str:
    if config is None:
        return (
            "### Settings of this folder\n\nNone are baked in: a call without `dynspec_config` uses the `dynspec` "
            "entry of the model's generation config, else the defaults above."
        )
    settings = json.dumps(config.to_dict(), indent=2)
    return (
        "### Settings of this folder\n\n`custom_generate/generate.py` carries these settings (its `SETTINGS`). They "
        "apply when the call passes no `dynspec_config` and neither the call's nor the model's generation config "
        f"has a `dynspec` entry:\n\n```json\n{settings}\n```"
    )


def _example_section(model_name: str | None) -> str:
    load = (
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")\n'
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder", padding_side="left")'
        if model_name is not None
        else 'model = AutoModelForCausalLM.from_pretrained("your/target-model")\n'
        'tokenizer = AutoTokenizer.from_pretrained("your/target-model", padding_side="left")'
    )
    return README_EXAMPLE.replace("{load}", load)


README_FRONT_MATTER = """---
library_name: transformers
tags:
- custom_generate
---"""

README_DESCRIPTION = """# hf_dynspec: batched, load-aware speculative decoding

## Description

Speculative decoding for `model.generate` that works on whole batches. A draft model (`assistant_model=`) or prompt
lookup proposes tokens, the target model checks them all in one forward pass, and every row of the batch keeps its
own number of accepted tokens. A policy picks each row's draft length every step, so speculation shrinks when it
does not pay off (low acceptance, a heavily loaded batch) and grows when it does.

It is lossless. With greedy decoding the output is token for token that of plain greedy `generate`. With sampling,
rejection sampling keeps the target model's distribution exactly. Logits processors, stopping criteria, EOS and
left-padded batches behave as in plain `generate`.

The code lives in the `hf-dynspec` package. `custom_generate/generate.py` only forwards the call to it."""

README_COMPATIBILITY = """## Model compatibility

- Decoder-only causal language models of `transformers` with full or sliding-window attention in every layer and
  the default dynamic KV cache (Llama, Qwen2, Mistral, Gemma 3 and similar). Chunked-attention, recurrent, static,
  quantized and offloaded caches are refused with an error that says so, as are encoder-decoder models.
- The draft model (`assistant_model=`) shares the target's tokenizer, or has its own: then pass `tokenizer=` and
  `assistant_tokenizer=` as in transformers' universal assisted decoding (chains only). Without a draft, set
  `prompt_lookup_num_tokens=` to draft from n-grams of the prompt.
- Batches of any size; they must be left-padded (`tokenizer.padding_side = "left"`).
- Greedy decoding and sampling (`do_sample=True`, with temperature, top-k, top-p and other logits processors), EOS,
  stop strings and custom stopping criteria, streamers (at batch size 1), several samples per prompt
  (`num_return_sequences` with `do_sample=True`), `output_scores` and `output_logits`, a KV cache that already holds
  a prompt prefix (`cache=`, left unchanged; not for sliding-window targets). Not supported: beam search,
  `output_attentions`, `output_hidden_states`.
- Requires the `hf-dynspec` package (see `custom_generate/requirements.txt`; transformers checks it before running
  the code)."""

README_ARGUMENTS = """## Additional Arguments

Besides the usual `generate` arguments:

- `assistant_model` (`PreTrainedModel`): the draft model.
- `dynspec_config` (`DynSpecConfig`, `dict` or path to a JSON file): the settings below. It defaults to the `dynspec`
  entry of the model's generation config (`DynSpecConfig(...).to_generation_config(model.generation_config)`), else to
  the settings of this folder, else to the defaults below.
- `dynspec_policy` (`DraftLengthPolicy`): a policy object to use instead of the one named in the settings.

Settings of `DynSpecConfig`:

{settings_table}"""

README_OUTPUT = """## Output Type changes

- Without `return_dict_in_generate=True` the output is the usual `torch.LongTensor` of sequences.
- With `return_dict_in_generate=True` the output is a `DynSpecOutput`, a `GenerateDecoderOnlyOutput` with one extra
  field, `dynspec_stats`: totals and per-step records (draft lengths, accepted tokens, timings) of the call.
  Its KV cache field (`cache`; `past_key_values` before transformers 5.24) is `None`: the loop's caches are not
  meant to be reused."""

README_TRUST = """## Why `trust_remote_code=True` is required

`custom_generate=` runs `custom_generate/generate.py` from this folder in your Python process. transformers treats it
like any other code that comes with a model repository, even from a local directory: it refuses to run it unless you
pass `trust_remote_code=True`. Read `custom_generate/generate.py` first. It is a few lines that call the installed
`hf-dynspec` package."""

README_EXAMPLE = """## Example usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

{load}
draft = AutoModelForCausalLM.from_pretrained("your/draft-model")  # same tokenizer as the target

inputs = tokenizer(["def fibonacci(n):", "The capital of France is"], return_tensors="pt", padding=True)
out = model.generate(
    **inputs,
    assistant_model=draft,
    custom_generate="path/to/this/folder",  # or the Hub id of this repository
    trust_remote_code=True,
    max_new_tokens=64,
    return_dict_in_generate=True,
)
print(tokenizer.batch_decode(out.sequences, skip_special_tokens=True))
print(out.dynspec_stats.acceptance_rate)
```

The same loop runs without this folder once `hf-dynspec` is installed:

```python
import hf_dynspec

out = model.generate(**inputs, assistant_model=draft, custom_generate=hf_dynspec.speculative_loop, max_new_tokens=64)
```"""
