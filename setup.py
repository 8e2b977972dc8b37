"""Install kareus-megatron: energy-aware planning and execution for megatron-core pipelines."""

from setuptools import find_packages, setup

# Versions the test suite runs against. torch is pinned exactly: 2.13.0 installs as a CPU build
# on machines without a GPU; any other version may pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
MEGATRON_CORE = "megatron-core==0.16.1"
DEEPSPEED = "deepspeed==0.19.8"
NVML = "nvidia-ml-py==13.615.71"

setup(
    name="kareus-megatron",
    version="0.1.0",
    description="Joint SM-clock and nanobatch-overlap planning for energy-efficient LLM training",
    python_requires=">=3.11",
    packages=find_packages(include=["kareus_megatron", "kareus_megatron.*"]),
    package_data={"kareus_megatron": ["hardware/*.toml", "workload/*.toml", "plan/*.json", "data/*"]},
    install_requires=[
        "numpy>=1.26",
        "scipy>=1.11",
        "pydantic>=2.6",
        "matplotlib>=3.8",
        "rich>=13",
        "pyyaml>=6",
    ],
    extras_require={
        "megatron": [TORCH, MEGATRON_CORE],
        "deepspeed": [TORCH, DEEPSPEED],
        "nvml": [NVML],
        "test": [TORCH, MEGATRON_CORE, DEEPSPEED, NVML, "pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "jsonschema>=4"],
        "bench": ["lowtime==0.3.0"],
    },
    entry_points={"console_scripts": ["kareus=kareus_megatron.cli.main:main"]},
)
