PYTHON ?= python3
export PYTHON

.PHONY: install demo test test-slow test-oldest lint docs report

install:
	bash scripts/install.sh

# Main job: a short benchmark on the embedded default models (HumanEval, 4 prompts at batch 1 and 8 at batch 4, 64 new
# tokens, 2 repetitions: plain generate, transformers' assisted generation and the default), ending in a summary line.
demo: install
	$(PYTHON) -m hf_dynspec.cli bench --scenario fixed --batch-sizes 1,4 --num-prompts 8 --batch-size-prompts 1=4 \
		--max-new-tokens 64 --repetitions 2 --methods plain,hf-assisted,dynspec-goodput \
		--out demo_results.json

# Tests (tiny models built from configs; no downloads), on every core (pytest-xdist, one torch thread a worker).
# `make test` runs all but the slow tier (statistical convergence and end-to-end: clients, servers, notebooks,
# several processes), which `make test-slow` runs; CI runs both.
TEST_WORKERS ?= auto
test: install
	$(PYTHON) -m ruff check src tests scripts evaluation
	$(PYTHON) -m pytest tests -m "not slow" -n $(TEST_WORKERS)

test-slow: install
	$(PYTHON) -m pytest tests -m slow -n $(TEST_WORKERS)

# Every figure of docs/benchmarks.md and the README recomputed from its results file (also a test of `make test`).
report:
	$(PYTHON) scripts/check_report.py

# The loop against the oldest transformers pyproject.toml allows (the rest of the environment as installed).
TRANSFORMERS_OLDEST ?= 5.20.0
test-oldest: install
	bash scripts/test_oldest.sh $(TRANSFORMERS_OLDEST)

lint:
	$(PYTHON) -m ruff check src tests scripts evaluation

# Documentation site; strict, so broken links and references fail the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict
