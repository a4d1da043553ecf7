"""The exported `custom_generate` folder runs the same loop as a direct call, and `export-hub` explains its errors."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, word_tokenizer
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import hf_dynspec
from hf_dynspec.commands import export_hub as export_hub_command
from hf_dynspec.config import GENERATION_CONFIG_KEY, DynSpecConfig
from hf_dynspec.hub import HubExportError, export_hub, render_generate_py, requirement_line

PAD, BOS, EOS = 0, 1, 2


def tiny_llama(seed: int) -> LlamaForCausalLM:
    return tiny_model("llama", seed, vocab=100, dtype=torch.float32, initializer_range=0.02,
                      pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_llama(0)


@pytest.fixture(scope="module")
def draft() -> LlamaForCausalLM:
    return tiny_llama(1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hub(tmp_path_factory.mktemp("hub") / "dynspec-method").out_dir


def prompts(batch_size: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts of different lengths."""
    rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]][:batch_size]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


# ---- the folder's files -----------------------------------------------------------------------------------------
def test_folder_layout(exported: Path) -> None:
    files = sorted(str(p.relative_to(exported)) for p in exported.rglob("*") if p.is_file())
    assert files == ["README.md", "custom_generate/generate.py", "custom_generate/requirements.txt"]


def test_requirements_name_the_installed_package(exported: Path) -> None:
    lines = (exported / "custom_generate" / "requirements.txt").read_text().split()
    assert lines == [requirement_line()]
    assert re.fullmatch(r"hf-dynspec>=\d+(\.\d+)*", lines[0])


def test_generate_py_imports_only_hf_dynspec(exported: Path) -> None:
    tree = ast.parse((exported / "custom_generate" / "generate.py").read_text())
    imported = [
        alias.name if isinstance(node, ast.Import) else (node.module or "")
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
        if not (isinstance(node, ast.ImportFrom) and node.level > 0)
    ]
    assert imported and all(name.split(".")[0] == "hf_dynspec" for name in imported)
    generate = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "generate")
    assert [a.arg for a in generate.args.args] == ["model"] and generate.args.kwarg is not None


def test_generate_py_carries_the_settings() -> None:
    config = DynSpecConfig(num_speculative_tokens=2, policy_options={"a": [1, 2]}, collect_step_stats=False)
    tree = ast.parse(render_generate_py(config))
    assign = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "SETTINGS")
    assert ast.literal_eval(assign.value) == config.to_dict()
    tree = ast.parse(render_generate_py(None))
    assign = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "SETTINGS")
    assert ast.literal_eval(assign.value) is None


def test_readme_front_matter_and_sections(exported: Path) -> None:
    readme = (exported / "README.md").read_text()
    front_matter = readme.split("---")[1]
    assert "tags:\n- custom_generate" in front_matter
    for heading in (
        "## Description",
        "## Base model",
        "## Model compatibility",
        "## Additional Arguments",
        "## Output Type changes",
        "## Why `trust_remote_code=True` is required",
        "## Example usage",
    ):
        assert f"\n{heading}\n" in readme, heading


def test_readme_lists_every_setting_with_type_default_and_help(exported: Path) -> None:
    readme = (exported / "README.md").read_text()
    for f in dataclasses.fields(DynSpecConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        row = f"| `{f.name}` | `{f.type}` | `{default!r}` | {f.metadata['help']} |"
        assert row in readme, f.name



def test_readme_code_compiles(exported: Path) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", (exported / "README.md").read_text(), re.DOTALL | re.MULTILINE)
    assert len(blocks) == 2
    for code in blocks:
        compile(code, "README.md", "exec")

# ---- generating through the folder ------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [1, 3])
def test_folder_gives_the_tokens_of_the_direct_call(exported: Path, target, draft, batch_size: int) -> None:
    inputs = prompts(batch_size)
    through_folder = target.generate(
        **inputs, assistant_model=draft, custom_generate=str(exported), trust_remote_code=True, max_new_tokens=12
    )
    direct = hf_dynspec.generate(target, **inputs, assistant_model=draft, max_new_tokens=12)
    callable_loop = target.generate(
        **inputs, assistant_model=draft, custom_generate=hf_dynspec.speculative_loop, max_new_tokens=12
    )
    assert through_folder.shape[0] == batch_size
    assert torch.equal(through_folder, direct)
    assert torch.equal(through_folder, callable_loop)


def test_folder_gives_the_samples_of_the_direct_call(exported: Path, target, draft) -> None:
    inputs = prompts(3)
    sampling = {"do_sample": True, "temperature": 0.9, "top_k": 20, "max_new_tokens": 10}
    static = DynSpecConfig(policy="static")  # draws depend on the draft lengths: the default's follow timings
    torch.manual_seed(123)
    through_folder = target.generate(
        **inputs, assistant_model=draft, custom_generate=str(exported), trust_remote_code=True, dynspec_config=static,
        **sampling,
    )
    torch.manual_seed(123)
    direct = hf_dynspec.generate(target, **inputs, assistant_model=draft, dynspec_config=static, **sampling)
    assert torch.equal(through_folder, direct)


def test_folder_returns_dynspec_stats(exported: Path, target, draft) -> None:
    out = target.generate(
        **prompts(3),
        assistant_model=draft,
        custom_generate=str(exported),
        trust_remote_code=True,
        max_new_tokens=8,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape[0] == 3
    assert out.dynspec_stats.batch_size == 3 and out.dynspec_stats.num_steps > 0


@pytest.mark.parametrize("trust", [None, False])
def test_transformers_refuses_without_trust_remote_code(exported: Path, target, draft, trust) -> None:
    kwargs = {} if trust is None else {"trust_remote_code": trust}
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        target.generate(**prompts(1), assistant_model=draft, custom_generate=str(exported), max_new_tokens=4, **kwargs)
    readme = " ".join((exported / "README.md").read_text().split())
    assert "it refuses to run it unless you pass `trust_remote_code=True`" in readme


# ---- which settings apply -----------------------------------------------------------------------------------------
def _max_requested(out) -> int:
    return max(max(step.requested_lengths) for step in out.dynspec_stats.steps)


def _generate_through(folder: Path, target, draft, **kwargs):
    return target.generate(
        **prompts(2),
        assistant_model=draft,
        custom_generate=str(folder),
        trust_remote_code=True,
        max_new_tokens=16,
        return_dict_in_generate=True,
        **kwargs,
    )


def test_settings_priority(tmp_path: Path, draft) -> None:
    """Explicit `dynspec_config` > the model's generation config > the folder's settings > defaults."""
    target = tiny_llama(0)
    folder = export_hub(tmp_path / "with-settings", config=DynSpecConfig(num_speculative_tokens=2, policy="static")).out_dir
    assert _max_requested(_generate_through(folder, target, draft)) == 2
    explicit = {"num_speculative_tokens": 1, "policy": "static"}
    assert _max_requested(_generate_through(folder, target, draft, dynspec_config=explicit)) == 1
    DynSpecConfig(num_speculative_tokens=3, policy="static").to_generation_config(target.generation_config)
    assert _max_requested(_generate_through(folder, target, draft)) == 3


def test_folder_without_settings_uses_defaults(exported: Path, target, draft) -> None:
    from hf_dynspec.policies import _LEARNED

    _LEARNED.pop(target, None)
    out = _generate_through(exported, target, draft)
    assert _max_requested(out) <= DynSpecConfig().num_speculative_tokens
    # the default policy (goodput) is remembered per target, draft and configuration: the defaults' configuration
    remembered = [json.loads(key[1]) for key in _LEARNED.get(target, {})]
    assert remembered == [DynSpecConfig().to_dict()]


# ---- exporting a model ------------------------------------------------------------------------------------------
@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-target"
    tiny_llama(0).save_pretrained(path)
    word_tokenizer(100, {"pad": PAD, "bos": BOS, "eos": EOS, "unk": 3}).save_pretrained(path)
    return path


def test_export_with_model_and_settings(tmp_path: Path, model_dir: Path, draft) -> None:
    config = DynSpecConfig(num_speculative_tokens=2, policy="static")  # drafts 2 every step, whatever the timings
    result = export_hub(tmp_path / "out", config=config, model=str(model_dir))
    out = result.out_dir
    assert result.model_name == "tiny-target" and result.tokenizer_saved
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    saved = json.loads((out / "generation_config.json").read_text())
    assert saved[GENERATION_CONFIG_KEY] == config.to_dict()
    assert "This folder also holds `tiny-target`" in (out / "README.md").read_text()

    # Loaded with trust_remote_code, the model's own generate is the exported method.
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    inputs = prompts(3)
    own = model.generate(**inputs, assistant_model=draft, max_new_tokens=10, return_dict_in_generate=True)
    assert own.dynspec_stats is not None and _max_requested(own) == 2
    direct = hf_dynspec.generate(tiny_llama(0), **inputs, assistant_model=draft, max_new_tokens=10)
    assert torch.equal(own.sequences, direct)


def test_export_model_without_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny_llama(0).save_pretrained(tmp_path / "bare")
    code = _run_cli([str(tmp_path / "out"), "--model", str(tmp_path / "bare")])
    assert code == 0
    assert "has no tokenizer files; only the model was saved" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "tokenizer_config.json").exists()


def test_unknown_model_name_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(HubExportError, match=r"neither a local model directory.*registry names are \["):
        export_hub(tmp_path / "out", model="no-such-model-name")


# ---- the command line and its errors ----------------------------------------------------------------------------
def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-dynspec")
    export_hub_command.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["export-hub", *argv])
    return args.func(args)


def test_cli_exports_with_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"num_speculative_tokens": 5, "policy": "static"}))
    assert _run_cli([str(tmp_path / "out"), "--config", str(settings)]) == 0
    printed = capsys.readouterr().out
    assert "custom_generate/generate.py" in printed and "README.md" in printed
    generate_py = (tmp_path / "out" / "custom_generate" / "generate.py").read_text()
    assert "'num_speculative_tokens': 5" in generate_py
    assert '"num_speculative_tokens": 5' in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (None, "--config file .* does not exist"),
        ("{not json", "--config file .*: Expecting property name"),
        ('{"num_speculative_tokens": -2}', "--config file .*`num_speculative_tokens` must be an integer >= 0"),
        ('{"num_spec_tokens": 2}', r"--config file .*Unknown DynSpecConfig key\(s\) \['num_spec_tokens'\]"),
        ('{"policy": "statc"}', r"--config file .*Unknown policy 'statc'"),
        ('{"policy": "goodput", "policy_options": {"windw": 5}}', r"--config file .*windw"),
    ],
)
def test_cli_reports_bad_settings(tmp_path: Path, capsys, contents: str | None, message: str) -> None:
    settings = tmp_path / "settings.json"
    if contents is not None:
        settings.write_text(contents)
    assert _run_cli([str(tmp_path / "out"), "--config", str(settings)]) == 2
    assert re.search(f"hf-dynspec export-hub: error: {message}", capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_non_empty_output_needs_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert _run_cli([str(out)]) == 2
    assert "is not empty; choose a new directory or pass --overwrite" in capsys.readouterr().err
    assert _run_cli([str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "keep me" and (out / "custom_generate" / "generate.py").is_file()


def test_output_path_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(HubExportError, match="is a file; give a directory"):
        export_hub(tmp_path / "file")


def test_unreadable_installed_version_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hf_dynspec.hub.importlib.metadata.version", lambda name: "unknown")
    with pytest.raises(HubExportError, match="Cannot read a release number from the installed hf-dynspec 'unknown'"):
        requirement_line()
