"""Packaging for ort_trainer. Install with ``pip install -e ".[cpu,dev]"`` after ``pip install torch==2.13.0``."""

from pathlib import Path

from setuptools import find_packages, setup

ORT_VERSION = "1.19.2"

setup(
    name="ort_trainer",
    version="0.1.0",
    description="Train PyTorch models through ONNX Runtime training graphs (the ORTTrainer API, revived)",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ort_trainer", "ort_trainer.*"]),
    install_requires=[
        # any torch 2.13.0 satisfies; install torch==2.13.0 first so pip takes the local CPU build
        "torch>=2.1",
        "numpy>=1.24",
        # onnx >= 1.18 writes IR versions ONNX Runtime 1.19 cannot read
        "onnx>=1.16,<1.18",
        "h5py>=3.8",
        "pyyaml>=6",
        "tqdm>=4.60",
        "matplotlib>=3.7",
    ],
    extras_require={
        # exactly one of cpu / cuda: both install the `onnxruntime` module
        "cpu": [f"onnxruntime-training-cpu=={ORT_VERSION}"],
        "cuda": [f"onnxruntime-training=={ORT_VERSION}"],
        "mpi": ["mpi4py>=3.1", "mpich"],
        "examples": ["scikit-learn>=1.3"],
        "hf": ["transformers>=4.40"],
        "bench": ["transformers>=4.40", "matplotlib>=3.7"],
        "dev": ["pytest>=7", "scikit-learn>=1.3", "transformers>=4.40"],
    },
    entry_points={"console_scripts": ["ort-trainer=ort_trainer.cli:main"]},
    classifiers=["Programming Language :: Python :: 3", "Topic :: Scientific/Engineering :: Artificial Intelligence"],
)
