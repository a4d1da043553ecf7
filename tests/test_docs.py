"""The code on the documentation pages runs: Python blocks execute in order against tiny local models.

Blocks that download models from the Hub (`from_pretrained("org/name")`) are replaced by the tiny models of this file;
`hf-dynspec export-hub` command lines run through the command's own parser. The site itself is built by `make docs`
(`mkdocs build --strict`), which fails on broken links and references.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, word_tokenizer
from transformers import LlamaForCausalLM

from hf_dynspec.commands import export_hub as export_hub_command

DOCS = Path(__file__).resolve().parent.parent / "docs"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.DOTALL | re.MULTILINE)
HUB_DOWNLOAD = re.compile(r"from_pretrained\(\"[^\"]+/[^\"]+\"")


def code_blocks(page: str) -> list[tuple[str, str]]:
    """`(language, code)` of every fenced block of `docs/<page>`, in order."""
    return FENCE.findall((DOCS / page).read_text())


def tiny_llama(seed: int) -> LlamaForCausalLM:
    return tiny_model("llama", seed, vocab=100, dtype=torch.float32, initializer_range=0.02,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)


def run_export_hub(command: str) -> None:
    parser = argparse.ArgumentParser(prog="hf-dynspec")
    export_hub_command.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(shlex.split(command)[1:])
    assert args.func(args) == 0, command


def run_page(page: str, namespace: dict) -> int:
    """Run the page's runnable blocks in order in `namespace`; returns how many ran."""
    ran = 0
    for language, code in code_blocks(page):
        if language == "python" and not HUB_DOWNLOAD.search(code):
            exec(compile(code, f"docs/{page}", "exec"), namespace)  # noqa: S102 - the documentation's own code
            ran += 1
        elif language == "bash" and code.startswith("hf-dynspec export-hub"):
            run_export_hub(code.strip())
            ran += 1
    return ran


@pytest.fixture()
def namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """What the pages' model-loading blocks define, with tiny models; the working directory is a fresh folder."""
    monkeypatch.chdir(tmp_path)
    tokenizer = word_tokenizer(100, {"pad": 0, "bos": 1, "eos": 2, "unk": 3})
    inputs = tokenizer(["w5 w6 w7 w8 w5 w6", "w9 w10"], return_tensors="pt", padding=True)
    return {"model": tiny_llama(0), "draft": tiny_llama(1), "tokenizer": tokenizer, "inputs": inputs}


def test_quickstart_blocks_run(namespace: dict) -> None:
    ran = run_page("quickstart.md", namespace)
    assert ran == 18
    assert Path("my-dynspec/custom_generate/generate.py").is_file()
    assert namespace["stats"].batch_size == 2


def test_hub_page_blocks_run(namespace: dict, tmp_path: Path) -> None:
    source = tmp_path / "tiny-model"
    namespace["model"].save_pretrained(source)
    namespace["tokenizer"].save_pretrained(source)
    run_export_hub(f"hf-dynspec export-hub OUT_DIR --model {source}")
    ran = run_page("hub.md", namespace)
    assert ran == 3
    assert namespace["out"].shape[0] == 2

