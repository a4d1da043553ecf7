PYTHON ?= python3
export PYTHON

.PHONY: install demo test test-oldest lint docs

install:
	bash scripts/install.sh

# Main job: a short benchmark on the embedded default models (scenario 1, HumanEval, batch sizes 1 and 4).
demo: install
	$(PYTHON) -m hf_dynspec.cli bench --scenario fixed --batch-sizes 1,4 --num-prompts 4 --batch-size-prompts 1=1 \
		--max-new-tokens 32 --repetitions 1 --methods plain,hf-assisted,dynspec-static:4,dynspec-goodput \
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
