#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels tools/gpu_check.sh installs on a GPU machine without one.
#
#   bash tools/fetch_gpu_wheels.sh [OUT_DIR]        (default: gpu_wheels/ in the repository root)
#
# Target: CPython 3.12, manylinux x86_64, with a CUDA torch ALREADY INSTALLED there (torch, triton, the
# nvidia-* wheels and torch's own dependencies jinja2, markupsafe, networkx, sympy, mpmath, setuptools are
# not fetched: multi-GB, and present with any torch; the small filelock, fsspec, typing_extensions are, as
# transformers / huggingface_hub pin newer ones).
# What moerl's GPU checks import beyond that: megatron-core 0.16.1, transformers (+ tokenizers, safetensors,
# huggingface_hub and theirs), the reference server (fastapi, uvicorn, pydantic), the client (httpx, aiohttp),
# numpy (usually installed with torch; pip skips it then), psutil, pyyaml, tqdm. The versions are the ones
# moerl was tested with when the list was made (the CPU venv; each inside setup.py's range, which
# tests/test_gpu_check.py checks: a fresh CPU venv may since have newer ones); every wheel is fetched with
# --no-deps, so this list is the whole closure (resolved once with `pip install --dry-run --report` for the same target, torch excluded).
#
# Not fetched (too large for the 60 MiB kit, or needs CUDA build tools): transformer-engine (the te_spec
# check SKIPs unless TE is preinstalled), sglang (server_step0 uses moerl's reference server), deep-ep,
# apex, and a CUDA toolkit (nvcc) for csrc/cuda (the kernels check SKIPs when the kernels do not build).
#
# Exits 1 when the folder exceeds MAX_MIB (60), listing the largest wheels.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$REPO/gpu_wheels}"
PYV="${PYV:-3.12}"
MAX_MIB="${MAX_MIB:-60}"
PY="${PYTHON:-python3}"

PKGS=(
  megatron-core==0.16.1 numpy==2.4.6 packaging==26.4
  transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 huggingface_hub==2.4.0 hf-xet==1.8.0
  regex==2026.11.19 pyyaml==6.0.4 tqdm==4.70.1 typer==0.29.2 click==8.5.1 shellingham==1.5.4
  rich==15.0.0 pygments==2.21.0 markdown-it-py==4.3.0 mdurl==0.1.2
  httpx==0.28.1 httpcore==1.0.9 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0 idna==3.20
  certifi==2026.10.19.post1 truststore==0.10.5
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5
  annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 opentelemetry-api==1.45.2
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1
  propcache==0.5.4 yarl==1.25.1
  psutil==7.2.2 filelock==4.3.1 fsspec==2026.9.0 typing_extensions==4.16.0
)
# for the GPU machine only (not in the CPU venv): ninja builds csrc/cuda with torch.utils.cpp_extension
# (nvcc itself must be there already; the kernels check says so when it is not)
GPU_ONLY_PKGS=(ninja==1.13.2)

mkdir -p "$OUT"
PKGS+=("${GPU_ONLY_PKGS[@]}")
echo "fetch_gpu_wheels: ${#PKGS[@]} wheels for CPython $PYV manylinux x86_64 into $OUT"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$OUT" \
  --python-version "$PYV" --implementation cp --abi "cp${PYV/./}" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  "${PKGS[@]}" 2> >(grep -v "is neither a file nor a directory" >&2)
printf '%s\n' "${PKGS[@]}" > "$OUT/requirements.txt"

total=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
mib=$(( (total + 1048575) / 1048576 ))
echo "fetch_gpu_wheels: $(ls "$OUT"/*.whl | wc -l) wheels, $mib MiB (limit $MAX_MIB MiB); largest:"
ls -S -s --block-size=K "$OUT"/*.whl | head -6 | sed 's/^/  /'
if [ "$mib" -gt "$MAX_MIB" ]; then
  echo "fetch_gpu_wheels: FAIL: $mib MiB > $MAX_MIB MiB" >&2
  exit 1
fi
echo "fetch_gpu_wheels: OK; bring the repository and $OUT to the GPU machine and run: bash tools/gpu_check.sh --wheels $(basename "$OUT")"
