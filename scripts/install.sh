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
# arctic-inference (the `suffix` extra) ships as source that builds against the installed torch: its build
# requirements would otherwise pull a second torch into an isolated build environment.
if ! $PYTHON -c "import arctic_inference.suffix_decoding" >/dev/null 2>&1; then
  $PIP install --quiet cmake ninja "nanobind==2.9.2" grpcio-tools "protobuf==5.29.6" setuptools wheel
  $PIP install --quiet --no-build-isolation "arctic-inference>=0.3,<0.4"
fi
$PIP install --quiet -e ".[dev,clients,evaluation,docs,bitsandbytes,suffix,serving]"
