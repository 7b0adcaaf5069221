# moerl GPU image (NVIDIA Hopper/Ampere). The CPU environment needs none of this: see README.
#
# Base: NGC PyTorch, which ships CUDA, NCCL, Transformer Engine and NVIDIA apex built together
# (PyPI's "apex" is an unrelated package: never pip install it).
#   docker build -t moerl:gpu .
#   docker run --gpus all --ipc=host -it moerl:gpu moerl train configs/tiny_arith.yaml
# Not built in moerl's CI (no Docker engine or GPU there): GPU checks run on a lent GPU machine.
ARG BASE=nvcr.io/nvidia/pytorch:25.04-py3
FROM ${BASE}

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_CUDA_ARCH_LIST="9.0"

# Megatron-Core: the GPU image may use a newer release than the CPU environment's 0.16.1
# (0.17+ needs Python >= 3.12, which NGC images have).
RUN pip install "megatron-core>=0.16.1" psutil

# Transformer Engine layers (model.layer_spec: auto picks them when TE imports and a GPU is visible) and
# FP8 training (precision.fp8) use the base image's Transformer Engine: its version decides which
# precision.fp8_recipe values Megatron-Core maps (tensorwise from TE 2.2, mxfp8 2.1, blockwise 2.3;
# moerl train checks the installed version and the GPU before any work, moerl/precision/te_fp8.py).

# SGLang rollout servers and the router (real SGLang pins its own kernels; install it here, never
# in the CPU environment). 0.5.9 is the version moerl's contract tests parse
# (tests/test_sglang_contract.py); it pins torch 2.9.1, so choose a BASE whose torch matches
# (or rebuild Transformer Engine after this step) - unverified until a GPU session builds the image.
RUN pip install "sglang[all]==0.5.9" "sglang-router==0.3.2"

# DeepEP V1 for Megatron's flex token dispatcher (Megatron-Core is written against DeepEP's V1
# Buffer API, <= v1.2.1; DeepEP main is V2). NVSHMEM from NVIDIA's wheel; DeepEP from source.
# PyPI's "deep-ep" is an incomplete third-party upload: never install it.
RUN pip install "nvidia-nvshmem-cu12>=3.2" \
 && git clone --depth 1 --branch v1.2.1 https://github.com/deepseek-ai/DeepEP.git /opt/DeepEP \
 && cd /opt/DeepEP \
 && NVSHMEM_DIR="$(python -c 'import nvidia.nvshmem, os; print(os.path.dirname(nvidia.nvshmem.__file__))')" \
    python setup.py install

WORKDIR /workspace/moerl
COPY . .
# --no-deps: keep the image's CUDA torch, TE and the packages installed above; pull only the rest.
RUN pip install --no-deps -e . \
 && pip install "transformers==5.24.0" "tokenizers>=0.22,<0.24" "datasets>=4.0,<6" "safetensors>=0.6,<0.9" \
      "fastapi>=0.115,<1" "uvicorn>=0.30,<1" "httpx>=0.27,<0.29" "pydantic>=2.7,<3" "pyyaml>=6.0,<7" \
      "tensorboard>=2.16,<3" "tqdm>=4.66,<5" "matplotlib>=3.8,<4" "pytest>=8,<10"

# moerl's native kernels (csrc/: C++ and CUDA, issue #15) compiled into the image's cache; `moerl doctor` reports them
RUN TORCH_CUDA_ARCH_LIST="9.0" python -m moerl.kernels._build --cuda
# Quick self-check at build time: the GPU-only imports resolve.
RUN python -c "import transformer_engine, megatron.core, sglang_router, deep_ep; print('GPU stack ok')"
