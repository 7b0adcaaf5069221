#!/usr/bin/env bash
# moerl's GPU check kit: run on a one-GPU machine with NO network, from this repository plus the wheel
# folder made by tools/fetch_gpu_wheels.sh on a machine with network. At most 8 minutes in all.
#
#   bash tools/gpu_check.sh [--wheels DIR] [--site DIR] [--no-install] [--budget-s S] [gpu_check.py args]
#
#   --wheels DIR   the wheel folder (default: gpu_wheels/ in the repository root when it exists)
#   --site DIR     where the wheels are installed (pip install --target; default /tmp/moerl_gpu_site),
#                  put in front of PYTHONPATH together with the repository; the preinstalled CUDA torch
#                  stays where it is. Nothing is installed into the system's site-packages.
#   --no-install   use the python as it is (every moerl dependency already installed)
#   --budget-s S   seconds for everything, install included (default 480 = 8 minutes)
#   other arguments go to tools/gpu_check.py (--dry-run, --only NAME..., --device cpu for a self-test)
#
# Prints the install step, then one PASS / FAIL / SKIP line per check and a SUMMARY line (tools/gpu_check.py).
# Exit code: gpu_check.py's (0: no FAIL, 1: a FAIL), 1 when the install fails, 124 when the whole run
# exceeds the budget. On a machine without a GPU every check SKIPs with its reason and the exit code is 0.
# PYTHON selects the interpreter (default python3; CPython 3.12 with a CUDA torch on the GPU machines).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
START=$(date +%s)
PY="${PYTHON:-python3}"
WHEELS=""
SITE=/tmp/moerl_gpu_site
INSTALL=1
BUDGET=480
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="${2:?--wheels needs a folder}"; shift 2 ;;
    --site) SITE="${2:?--site needs a folder}"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --budget-s) BUDGET="${2:?--budget-s needs seconds}"; shift 2 ;;
    --dry-run) INSTALL=0; ARGS+=("$1"); shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]] || [ "$BUDGET" -lt 60 ]; then
  echo "gpu_check.sh: bad CLI input: --budget-s $BUDGET must be an integer >= 60" >&2
  echo "  fix: give --budget-s 480 (8 minutes)" >&2
  exit 2
fi
if [ -z "$WHEELS" ] && [ -d "$REPO/gpu_wheels" ]; then WHEELS="$REPO/gpu_wheels"; fi
if [ -n "$WHEELS" ] && [ ! -f "$WHEELS/requirements.txt" ]; then
  echo "gpu_check.sh: bad CLI input: --wheels $WHEELS has no requirements.txt (not made by tools/fetch_gpu_wheels.sh)" >&2
  echo "  fix: run bash tools/fetch_gpu_wheels.sh $WHEELS on a machine with network, or give --no-install" >&2
  exit 2
fi

if [ "$INSTALL" = 1 ] && [ -n "$WHEELS" ]; then
  stamp="$SITE/.moerl_requirements"
  if [ -f "$stamp" ] && cmp -s "$stamp" "$WHEELS/requirements.txt"; then
    echo "gpu_check.sh: wheels already installed in $SITE"
  else
    echo "gpu_check.sh: installing $(wc -l < "$WHEELS/requirements.txt") wheels from $WHEELS into $SITE (offline)"
    rm -rf "$SITE"
    if ! "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" --no-deps --target "$SITE" \
         -r "$WHEELS/requirements.txt" 2> >(grep -v -e "is neither a file nor a directory" -e "as the 'root' user" >&2); then
      echo "FAIL install: pip could not install the wheels of $WHEELS for $("$PY" -V 2>&1) (made for CPython 3.12?)"
      echo "SUMMARY: 0 PASS, 1 FAIL, 0 SKIP (install failed)"
      exit 1
    fi
    cp "$WHEELS/requirements.txt" "$stamp"
  fi
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"  # bin: ninja for csrc/cuda
else
  [ "$INSTALL" = 1 ] && echo "gpu_check.sh: no wheel folder (make one with tools/fetch_gpu_wheels.sh); using $PY as it is"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
export OMP_WAIT_POLICY=PASSIVE TORCHDYNAMO_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/moerl_torch_extensions}"
left=$(( BUDGET - ($(date +%s) - START) ))
if [ "$left" -lt 40 ]; then
  echo "FAIL budget: only $left s of $BUDGET s left after the install; nothing checked (gpu_check.sh --budget-s)"
  exit 124
fi
# the checks get what is left minus a margin for start-up and the summary; timeout is the backstop
timeout --kill-after=10 "$left" "$PY" "$REPO/tools/gpu_check.py" --budget-s $(( left - 20 )) "${ARGS[@]+"${ARGS[@]}"}"
rc=$?
if [ $rc -eq 124 ]; then echo "FAIL budget: the checks did not finish within $BUDGET s (gpu_check.sh --budget-s)"; fi
exit $rc
