"""Packaging for ort_trainer.

Install with ``pip install -e ".[cpu,dev]"`` after ``pip install torch==2.13.0``. The ONNX Runtime
comes from exactly one extra: ``cpu`` (the current onnxruntime), ``cuda`` (onnxruntime-gpu) or
``training`` (the 1.19.2 training build). Every one of them installs the ``onnxruntime`` module, so
none is in the base requirements and two must never be installed together; importing ort_trainer
checks that.
"""

from pathlib import Path

from setuptools import find_packages, setup

CURRENT_ORT = "1.31.*"  # the release the project is tested on
TRAINING_ORT = "1.19.2"
ONNXSCRIPT = "onnxscript>=0.7"  # torch.onnx.export(dynamo=True): the torch gradient source
ONNX2FX = "onnx2fx==0.0.1"  # ONNX models with their loss, as torch modules (needs onnx >= 1.19.1)
# `make docs`: the API reference from the docstrings (in dev too: the test suite builds it)
DOCS = ["mkdocs>=1.6", "mkdocstrings[python]>=0.26", "mkdocstrings-python>=1.16"]

setup(
    name="ort_trainer",
    version="0.1.0",
    description="Train PyTorch models through ONNX Runtime training graphs (the ORTTrainer API, revived)",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ort_trainer", "ort_trainer.*"]),
    # the kernel library's sources, compiled on first use (ort_trainer/kernels)
    package_data={"ort_trainer.kernels": ["csrc/*.h", "csrc/*.cuh", "csrc/*.cc", "csrc/*.cu"]},
    install_requires=[
        # any torch 2.13.0 satisfies; install torch==2.13.0 first so pip takes the local CPU build
        "torch>=2.1",
        "numpy>=1.24",
        "onnx>=1.16",
        "h5py>=3.8",
        "pyyaml>=6",
        "tqdm>=4.60",
        "matplotlib>=3.7",
    ],
    extras_require={
        # Exactly one runtime extra. The current runtimes read today's ONNX IR versions; onnx >= 1.18
        # there also makes pip refuse [cpu,training] or [cuda,training] as unresolvable.
        "cpu": [f"onnxruntime=={CURRENT_ORT}", "onnx>=1.19.1", ONNXSCRIPT, ONNX2FX],
        "cuda": [f"onnxruntime-gpu=={CURRENT_ORT}", "onnx>=1.19.1", ONNXSCRIPT, ONNX2FX],
        # onnx >= 1.18 writes IR versions ONNX Runtime 1.19 cannot read; onnxscript needs onnx >= 1.17
        "training": [f"onnxruntime-training-cpu=={TRAINING_ORT}", "onnx==1.17.*", ONNXSCRIPT],
        "mpi": ["mpi4py>=3.1", "mpich"],
        "examples": ["scikit-learn>=1.3"],
        "hf": ["transformers>=4.40"],
        # logging.tensorboard of the command line (torch.utils.tensorboard writes with its event writer)
        "tensorboard": ["tensorboard>=2.14"],
        "bench": ["transformers>=4.40", "matplotlib>=3.7"],
        "docs": DOCS,
        "dev": ["pytest>=7", "pytest-xdist>=3.5", "scikit-learn>=1.3", "transformers>=4.40", "tensorboard>=2.14", *DOCS],
    },
    entry_points={"console_scripts": ["ort-trainer=ort_trainer.cli:main"]},
    classifiers=["Programming Language :: Python :: 3", "Topic :: Scientific/Engineering :: Artificial Intelligence"],
)
