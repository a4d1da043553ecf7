PYTHON ?= python3
export PYTHON

.PHONY: install demo test lint docs

install:
	bash scripts/install.sh

# Main job: a short benchmark on the embedded default models.
demo: install
	$(PYTHON) -m hf_dynspec.cli demo

# Tests (tiny models built from configs; no downloads).
test: install
	$(PYTHON) -m ruff check src tests
	$(PYTHON) -m pytest tests

lint:
	$(PYTHON) -m ruff check src tests

# Documentation site; strict, so broken links and references fail the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict
