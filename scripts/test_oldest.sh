#!/usr/bin/env bash
# Runs the loop's core tests against the oldest transformers release pyproject.toml allows, in a throw-away virtual
# environment that sees every package of the *active* environment (torch and the package itself included), whether
# that is the machine's python or an activated venv: `--system-site-packages` would show only the base interpreter's
# packages, so the throw-away environment instead adds the active one's site-packages after its own (a `.pth` file),
# and its own transformers comes first.
set -euo pipefail
VERSION="${1:?usage: test_oldest.sh TRANSFORMERS_VERSION}"
PYTHON="${PYTHON:-python3}"
VENV="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$VENV")"' EXIT
bash "$(dirname "$0")/nested_venv.sh" "$PYTHON" "$VENV"
"$VENV/bin/python" -m pip install --quiet "transformers==$VERSION"
"$VENV/bin/python" -c "import transformers; print('transformers', transformers.__version__)"
"$VENV/bin/python" -m pytest -p no:cacheprovider -n auto tests/test_greedy_equivalence.py tests/test_transformers_compat.py \
  tests/test_sliding_window.py tests/test_prefix_cache.py tests/test_translated_draft.py \
  tests/test_tree.py tests/test_sampling.py tests/test_continuous.py tests/test_serving.py tests/test_coupling.py \
  tests/test_coupling_continuous.py tests/test_rollout_reuse.py
