"""moerl: RL post-training for Mixture-of-Experts language models (Megatron-Core + SGLang API)."""

from setuptools import find_packages, setup

setup(
    name="moerl",
    version="0.1.0",
    description="Reinforcement-learning post-training for Mixture-of-Experts language models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["moerl", "moerl.*"]),
    package_data={"moerl": ["py.typed"]},
    install_requires=[
        # CPU environment (see shared/design/CPU_MEGATRON.md): megatron-core 0.17+ needs Python >= 3.12.
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "numpy>=1.26,<3",
        "psutil>=5.9",  # needed by megatron dist_checkpointing's writer, not declared by it
        "transformers==5.24.0",
        "tokenizers>=0.22,<0.24",
        "datasets>=4.0,<6",
        "safetensors>=0.6,<0.9",
        "sglang-router==0.3.2",
        "fastapi>=0.115,<1",
        "uvicorn>=0.30,<1",
        "httpx>=0.27,<0.29",  # synchronous control calls (weight sync, health checks)
        "aiohttp>=3.9,<4",  # RolloutClient: ~7x less client CPU than httpx for 128 concurrent /generate
        "pydantic>=2.7,<3",
        "pyyaml>=6.0,<7",
        "tensorboard>=2.16,<3",
        "tqdm>=4.66,<5",
        "matplotlib>=3.8,<4",  # tools/inspect_experts.py plots
        "pyarrow>=15",  # parquet prompts (moerl/data/dataset.py); also required by datasets
        "math-verify[antlr4_13_2]==0.9.0",  # reward.function: math (LaTeX parsing needs the antlr4 runtime)
        "reasoning-gym==0.1.25",  # data.task: reasoning_gym and reward.function: reasoning_gym
    ],
    extras_require={
        # accelerate: transformers' FineGrainedFP8 loader reads moerl's FP8 rollout checkpoints (tests/test_fp8_rollout.py)
        "test": ["pytest>=8,<10", "pytest-xdist>=3.5,<4", "accelerate>=1.0,<2"],
        "wandb": ["wandb"],
    },
    entry_points={"console_scripts": ["moerl=moerl.cli:main"]},
)
