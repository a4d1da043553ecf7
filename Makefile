PYTHON ?= python3
export PYTHON

.PHONY: install demo test test-oldest lint docs

install:
	bash scripts/install.sh

# Main job: a short benchmark on the embedded default models (HumanEval, 4 prompts at batch 1 and 8 at batch 4, 64 new
# tokens, 2 repetitions: plain generate, transformers' assisted generation and the default), ending in a summary line.
demo: install
	$(PYTHON) -m hf_dynspec.cli bench --scenario fixed --batch-sizes 1,4 --num-prompts 8 --batch-size-prompts 1=4 \
		--max-new-tokens 64 --repetitions 2 --methods plain,hf-assisted,dynspec-goodput \
		--out demo_results.json

# Tests (tiny models built from configs; no downloads).
test: install
	$(PYTHON) -m ruff check src tests
	$(PYTHON) -m pytest tests

# The loop against the oldest transformers pyproject.toml allows (the rest of the environment as installed).
TRANSFORMERS_OLDEST ?= 5.20.0
test-oldest: install
	bash scripts/test_oldest.sh $(TRANSFORMERS_OLDEST)

lint:
	$(PYTHON) -m ruff check src tests

# Documentation site; strict, so broken links and references fail the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict
