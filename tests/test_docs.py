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



def test_rollouts_page_blocks_run(namespace: dict) -> None:
    """TRL's GRPOTrainer (a bound draft, then a LoRA target), lm-evaluation-harness, suffix speculation and rollout
    reuse over two epochs, as the page writes them."""
    ran = run_page("rollouts.md", namespace)
    assert ran == 5
    assert namespace["rollouts"].shape[0] == 4  # the suffix block's second epoch
    # the second epoch found the first's samples (whether proposing them pays is the policy's call, by timings)
    assert namespace["second"].dynspec_stats.rollout_rows == 4 and namespace["reused"] >= 0
    assert namespace["second"].sequences.equal(namespace["first"].sequences)  # nothing moved: the same samples
    assert namespace["trainer"].state.global_step == 2
    assert type(namespace["trainer"].model).__name__ == "PeftModelForCausalLM"
    assert len(namespace["completions"]) == 2
    assert getattr(namespace["model"], "_dynspec_binding", None) is None  # every block ends with disable


def test_serving_page_blocks_run(namespace: dict) -> None:
    """`generate_batch`, a speculating manager and an enabled model's own `generate_batch`, as the page writes them
    (the client block needs a running server: `tests/test_serving.py` runs one)."""
    ran = run_page("serving.md", namespace)
    assert ran == 3
    assert namespace["manager"].speculation.requests == 1
    assert len(namespace["outputs"]) == len(namespace["with_draft"]) == 3
    assert getattr(namespace["model"], "_dynspec_binding", None) is None


REPORT = DOCS / "benchmarks.md"
README = DOCS.parent / "README.md"
SPEED_RATIO = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x\b")
REPORT_LINK = re.compile(r"\(docs/benchmarks\.md#([\w-]+)\)")


def speed_ratios(text: str) -> set[str]:
    """Every number written as a speed ratio (`1.73x`, `2x`) in `text`."""
    return set(SPEED_RATIO.findall(text))


def heading_anchor(heading: str) -> str:
    """The anchor mkdocs (and GitHub, for these headings) gives a heading: lower case, punctuation dropped, words joined
    by hyphens."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def test_benchmark_report_reads_in_minutes() -> None:
    """The report keeps the current run of each scenario; earlier runs belong in `docs/benchmarks/history.md`."""
    lines = REPORT.read_text().splitlines()
    assert len(lines) <= 400, f"docs/benchmarks.md has {len(lines)} lines; move earlier runs to the history"


def test_speed_ratios_on_the_front_pages_are_in_the_report() -> None:
    report = speed_ratios(REPORT.read_text())
    for page in (README, DOCS / "index.md"):
        missing = speed_ratios(page.read_text()) - report
        assert not missing, f"{page.name} claims {sorted(missing)}, which docs/benchmarks.md does not show"


def test_readme_links_into_the_report_resolve() -> None:
    prose = re.sub(r"^```.*?^```", "", REPORT.read_text(), flags=re.DOTALL | re.MULTILINE)
    anchors = {heading_anchor(line.lstrip("#")) for line in prose.splitlines() if line.startswith("#")}
    links = REPORT_LINK.findall(README.read_text())
    assert links, "README.md links its numbers to the report"
    assert set(links) <= anchors, sorted(set(links) - anchors)


def test_speed_ratios_are_found_as_written() -> None:
    assert speed_ratios("1.73x plain, against 1.49x; 2x at most; 0x1f and x86 are not ratios") == {"1.73x", "1.49x", "2x"}
    assert speed_ratios("1.551x-1.313x") == {"1.551x", "1.313x"}
    assert "1.4x" not in speed_ratios("11.4x and 1.45x")
