#!/usr/bin/env bash
# End-to-end decode throughput of a 1B-class Llama (Llama-3.2-1B shapes, random bf16 weights,
# no download) at 1, 64 and 256 concurrent sequences, against the HBM roofline measured in
# the same run. Needs only a Python with jax[cuda] (0.10 or 0.11) and numpy; jaxpaged is used
# from this checkout (pip install not required). Target: under 6 minutes on one H200.
#
#   bench/gpu_bench.sh                 # on the GPU machine
#   bench/gpu_bench.sh --dry-run       # tiny config on CPU: checks the script itself
#   OUT=/some/dir bench/gpu_bench.sh   # also writes OUT/gpu_bench.json and OUT/gpu_bench.log
#   PYTHON=.venv/bin/python bench/gpu_bench.sh --attention-backend xla
#
# If the default (Pallas) attention backend fails, the run is repeated with the XLA backend.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
out="${OUT:-}"
limit="${GPU_BENCH_TIMEOUT:-330}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[[ " $* " == *" --dry-run "* ]] && export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"

"$PYTHON" -c 'import jax; print("jax", jax.__version__, "devices", jax.devices())' || exit 1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader

run() {
  local json=()
  [[ -n "$out" ]] && mkdir -p "$out" && json=(--json-out "$out/gpu_bench${1}.json")
  shift
  if [[ -n "$out" ]]; then
    timeout "$limit" "$PYTHON" "$here/gpu_decode.py" "${json[@]}" "$@" 2>&1 | tee -a "$out/gpu_bench.log"
  else
    timeout "$limit" "$PYTHON" "$here/gpu_decode.py" "$@" 2>&1
  fi
}

start=$SECONDS
run "" "$@"
rc=$?
if [[ $rc -ne 0 && " $* " != *" --attention-backend "* && " $* " != *" --dry-run "* ]]; then
  echo "gpu_bench: default attention backend failed (rc $rc); retrying with --attention-backend xla"
  run "_xla" "$@" --attention-backend xla
  rc=$?
fi
echo "gpu_bench: rc $rc in $((SECONDS - start)) s"
exit $rc
