#!/usr/bin/env bash
# The device check, one command for a GPU lent for minutes (no network): the tests that need CUDA, then the
# measurements of `hf_dynspec.evaluation.device_check` on random-weight Qwen2.5 1.5B / 0.5B configs, into one JSON file
# and a short text summary. At most 8 minutes on one GPU. `--device cpu` runs tiny configs in seconds (CI runs it).
#
#   bash scripts/device_check.sh [--device cuda|cpu] [--out DIR] [--wheels DIR]
#
# It uses the Python environment it finds (PYTHON, default python3) and this checkout's `src/` (no install needed).
# Packages missing there are installed from the wheels in `--wheels DIR` (default: `wheels/` in the checkout), with no
# index: fill that folder beforehand on a machine with network, e.g.
#   pip download --dest wheels torch transformers numpy tqdm pytest hypothesis
# Without them it stops and names what is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEVICE=cuda
OUT="$ROOT/device_check_results"
WHEELS="$ROOT/wheels"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "device_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ "$DEVICE" != cuda && "$DEVICE" != cpu ]]; then
  echo "device_check: --device must be cuda or cpu, got '$DEVICE'" >&2; exit 2
fi
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || { echo "device_check: no Python at '$PYTHON' (set PYTHON)" >&2; exit 3; }
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"

# 1. Dependencies: what is installed, else the carried wheels, else a clear stop.
modules="torch transformers numpy tqdm"
[[ "$DEVICE" == cuda ]] && modules="$modules pytest hypothesis"  # for the tests
read -r -a missing <<< "$("$PYTHON" -c "import importlib.util as u, sys
print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))" $modules)"
if [[ ${#missing[@]} -gt 0 ]]; then
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "device_check: installing ${missing[*]} from $WHEELS (no index)"
    "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" "${missing[@]}"
  else
    echo "device_check: $PYTHON lacks ${missing[*]}, and $WHEELS holds no wheels to install them from (no network" \
      "here). Carry them along: pip download --dest wheels ${missing[*]}" >&2
    exit 3
  fi
fi
if [[ "$DEVICE" == cuda ]] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "device_check: --device cuda, but torch sees no CUDA device; use --device cpu for the CPU check" >&2
  exit 4
fi
mkdir -p "$OUT"

# 2. The tests that need CUDA (they skip without one, so the CPU check leaves them out). The measurements run
# whatever they find; the script's status says whether they passed.
tests=0
if [[ "$DEVICE" == cuda ]]; then
  timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_placement.py -k "cuda or gpu" \
    2>&1 | tee "$OUT/cuda_tests.txt" || tests=$?
fi

# 3. The measurements.
timeout 300 "$PYTHON" -m hf_dynspec.evaluation.device_check --device "$DEVICE" --out "$OUT"
echo "device_check: results in $OUT/device_check.json and $OUT/device_check.txt"
if [[ $tests -ne 0 ]]; then
  echo "device_check: the CUDA tests failed (status $tests), see $OUT/cuda_tests.txt" >&2
fi
exit "$tests"
