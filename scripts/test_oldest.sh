#!/usr/bin/env bash
# Runs the loop's core tests against the oldest transformers release pyproject.toml allows, in a throw-away virtual
# environment that sees every other installed package (torch and the package itself included).
set -euo pipefail
VERSION="${1:?usage: test_oldest.sh TRANSFORMERS_VERSION}"
PYTHON="${PYTHON:-python3}"
VENV="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$VENV")"' EXIT
$PYTHON -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --quiet "transformers==$VERSION"
"$VENV/bin/python" -c "import transformers; print('transformers', transformers.__version__)"
"$VENV/bin/python" -m pytest -p no:cacheprovider tests/test_greedy_equivalence.py tests/test_transformers_compat.py \
  tests/test_sliding_window.py tests/test_prefix_cache.py tests/test_translated_draft.py \
  tests/test_tree.py tests/test_sampling.py
