"""sparse-rl-megatron: Sparse-RL (GRPO on compressed-KV rollouts) with a megatron-core learner and SGLang."""
from setuptools import find_packages, setup

setup(
    name="sparse-rl-megatron",
    version="0.1.0",
    description="Sparse-RL: RL of LLM reasoning with compressed-KV rollouts, megatron-core learner, SGLang plugin",
    python_requires=">=3.11",
    packages=find_packages(include=["sparse_rl_megatron", "sparse_rl_megatron.*", "sglang_ext", "sglang_ext.*"]),
    package_data={"sparse_rl_megatron": ["py.typed", "models/configs/*.json"], "sglang_ext": ["cpu_stubs/**/*.py"]},
    # Pinned versions and the CPU/GPU split live in requirements/*.txt, installed by launch/setup_env.sh.
    install_requires=[
        "torch>=2.9",
        "megatron-core>=0.16.1",
        "transformers>=5.19,<5.20",
        "safetensors",
        "math-verify>=0.9",
        "pyyaml",
        "rich",
        "tqdm",
        "tensorboard",
        "matplotlib",
        "psutil",
    ],
    extras_require={"test": ["pytest", "pytest-timeout", "hypothesis"]},
    entry_points={
        "console_scripts": ["sparse-rl=sparse_rl_megatron.cli:main"],
        "sglang.srt.plugins": ["sparse_rl_kv = sglang_ext.plugin:register"],
    },
)
