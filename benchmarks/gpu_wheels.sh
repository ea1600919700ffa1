#!/usr/bin/env bash
# `make gpu-wheels`: what a GPU machine without network lacks for `make gpu-check` (Python 3.12,
# x86-64), in parts of at most PART_MIB MiB, so that each can be carried on its own:
#   onnxruntime-gpu.tar.xz.part-NN  onnxruntime-gpu 1.31.1 (a 256 MB wheel) unpacked without its
#                                   TensorRT provider library (unused) and recompressed with xz:
#                                   193 MiB, 4 parts of 60 MiB instead of 5
#   onnx2fx, mpich and mpi4py wheels (mpiexec and an MPI library for the cuda tests of several ranks)
#   install.sh                      run there: joins the parts and installs (benchmarks/gpu_install.sh)
# Usage: benchmarks/gpu_wheels.sh [DIR (.gpu-wheels)]; PYTHON and PART_MIB (60) from the environment.
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
(cd "$dir" && md5sum onnxruntime-gpu.tar.xz.part-* > parts.md5)
ls -l "$dir"
