#!/usr/bin/env bash
# Installs hf_dynspec with every extra into the current Python environment.
# PyTorch: the CPU build when this machine offers it (pip install torch==2.13.0 resolves to a local CPU wheel here);
# otherwise whatever satisfies the package's own range.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
PIP="$PYTHON -m pip"
if ! $PYTHON -c "import torch" >/dev/null 2>&1; then
  $PIP install --quiet "torch==2.13.0" || $PIP install --quiet "torch>=2.4"
fi
$PIP install --quiet -e ".[dev,clients,evaluation,docs,bitsandbytes]"
