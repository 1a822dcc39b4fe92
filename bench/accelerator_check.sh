#!/usr/bin/env bash
# One prioritized check of jaxpaged on a GPU or TPU, within a global deadline (default 400 s,
# ACCELERATOR_CHECK_DEADLINE_S), writing each result to stdout and to $OUT/accelerator_check.md
# as it is known (bench/accelerator_check.py has the stages). No network: jaxpaged is imported
# from this checkout; needs jax (0.10 or 0.11, with its CUDA or TPU plugin), numpy, ml_dtypes
# and tqdm. A hard `timeout` 20 s past the deadline keeps the whole run inside one call.
#
#   bash bench/accelerator_check.sh               # on the GPU/TPU machine (python3 there)
#   bash bench/accelerator_check.sh --dry-run     # every stage on the CPU, tiny, interpret mode
#   PYTHON=.venv/bin/python bash bench/accelerator_check.sh --dry-run --as tpu
#   .venv/bin/python bench/accelerator_check.py --write-expected   # refresh the CPU tokens
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
deadline="${ACCELERATOR_CHECK_DEADLINE_S:-400}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false ACCELERATOR_CHECK_DEADLINE_S="$deadline"
[[ " $* " == *" --dry-run "* ]] && export JAX_PLATFORMS=cpu
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader | sed 's/^/nvidia-smi: /' | tee -a "$OUT/accelerator_check.md"
  timeout "$((${deadline%.*} + 20))" "$PYTHON" "$here/accelerator_check.py" "$@" 2>&1 \
    | tee "$OUT/accelerator_check.log"
else
  timeout "$((${deadline%.*} + 20))" "$PYTHON" "$here/accelerator_check.py" "$@" 2>&1
fi
rc=$?
echo "accelerator_check: rc $rc"
exit $rc
