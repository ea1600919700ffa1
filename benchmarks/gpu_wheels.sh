#!/usr/bin/env bash
# `make gpu-wheels`: what a GPU machine without network lacks for `make gpu-check` (Python 3.12,
# x86-64), in parts of at most PART_MIB MiB, so that each can be carried on its own:
#   onnxruntime-gpu.tar.xz.part-NN  onnxruntime-gpu 1.31.1 (a 256 MB wheel) unpacked without its
#                                   TensorRT provider library (unused) and recompressed with xz:
#                                   193 MiB, 4 parts of 60 MiB instead of 5
#   onnx2fx, mpich and mpi4py wheels (mpiexec and an MPI library for the cuda tests of several ranks)
#   libort_trainer_kernels.so       ort_trainer's kernel library built here with nvcc (ort_trainer/kernels), where
#                                   nvcc is found: the GPU machine then needs no compiler (1.2 MB)
#   install.sh                      run there: joins the parts and installs (benchmarks/gpu_install.sh)
# Usage: benchmarks/gpu_wheels.sh [DIR (.gpu-wheels)]; PYTHON, PART_MIB (60) and KERNELS_PYTHON (a Python that
# imports ort_trainer; PYTHON by default) from the environment.
set -euo pipefail
python=${PYTHON:-python3}
dir=${1:-.gpu-wheels}
part_mib=${PART_MIB:-60}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$work" \
    "onnxruntime-gpu==1.31.1" "onnx2fx==0.0.1" "mpich==5.0.2" "mpi4py==4.1.2"
mkdir "$work/ort"
(cd "$work/ort" && unzip -q "$work"/onnxruntime_gpu-*.whl \
    && rm -f onnxruntime/capi/libonnxruntime_providers_tensorrt.so \
    && tar cf - . | xz -T0 -9 > "$work/onnxruntime-gpu.tar.xz")
mkdir -p "$dir"
rm -f "$dir"/onnxruntime-gpu.tar.xz.part-*
split -b "${part_mib}M" -d "$work/onnxruntime-gpu.tar.xz" "$dir/onnxruntime-gpu.tar.xz.part-"
mv "$work"/onnx2fx-*.whl "$work"/mpich-*.whl "$work"/mpi4py-*.whl "$dir/"
cp "$(dirname "$0")/gpu_install.sh" "$dir/install.sh"
if command -v "${NVCC:-nvcc}" >/dev/null; then
    rm -f "$dir/libort_trainer_kernels.so"
    "${KERNELS_PYTHON:-$python}" -c "import sys; from pathlib import Path; from ort_trainer.kernels import build
build(Path(sys.argv[1]), cuda=True)" "$dir"
else
    echo "gpu_wheels: no nvcc here: the GPU machine builds ort_trainer's kernel library itself (or needs nvcc)" >&2
fi
(cd "$dir" && md5sum onnxruntime-gpu.tar.xz.part-* > parts.md5)
ls -l "$dir"
