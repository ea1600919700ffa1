#!/usr/bin/env bash
# `make gpu-wheels`: what a GPU machine without network lacks for `make gpu-check` (Python 3.12,
# x86-64), in files of at most PART_MIB MiB, so that each can be carried on its own:
#   DIR/onnxruntime-gpu.tar.xz.part-NN  onnxruntime-gpu 1.31.1 (a 256 MB wheel) unpacked and recompressed with xz:
#                                   without its TensorRT provider library and its C API library
#                                   (libonnxruntime.so: the Python module does not load it), its CUDA
#                                   provider's GPU code for other GPUs than GPU_ARCHS zeroed
#                                   (benchmarks/fatbin_prune.py): with GPU_ARCHS=90 (H100, H200; the default)
#                                   56 MiB, one part; GPU_ARCHS=all keeps every GPU's code (193 MiB, 4 parts).
#                                   Everything in DIR: 57 MiB, which one call of 64 MiB carries with the checkout
#   DIR/onnx2fx wheel
#   DIR/libort_trainer_kernels.so.xz  ort_trainer's kernel library built here with nvcc (ort_trainer/kernels),
#                                   where nvcc is found: the GPU machine then needs no compiler (4 MB, 0.6 xz)
#   DIR/install.sh                  run there: joins the parts and installs (benchmarks/gpu_install.sh)
#   DIR-mpi/mpich, mpi4py wheels    mpiexec and an MPI library, for the cuda tests of several ranks alone
#                                   (14 MiB): carried beside DIR when those run, install.sh finds them there
# Usage: benchmarks/gpu_wheels.sh [DIR (.gpu-wheels)]; PYTHON, PART_MIB (60), GPU_ARCHS ("90"; several:
# "80 90") and KERNELS_PYTHON (a Python that imports ort_trainer; PYTHON by default) from the environment.
set -euo pipefail
python=${PYTHON:-python3}
dir=${1:-.gpu-wheels}
part_mib=${PART_MIB:-60}
archs=${GPU_ARCHS:-90}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$work" \
    "onnxruntime-gpu==1.31.1" "onnx2fx==0.0.1" "mpich==5.0.2" "mpi4py==4.1.2"
mkdir "$work/ort"
(cd "$work/ort" && unzip -q "$work"/onnxruntime_gpu-*.whl \
    && rm -f onnxruntime/capi/libonnxruntime_providers_tensorrt.so onnxruntime/capi/libonnxruntime.so.*)
if [ "$archs" != all ]; then
    keep=()
    for arch in $archs; do keep+=(--keep "$arch"); done
    "$python" "$here/fatbin_prune.py" "$work/ort/onnxruntime/capi/libonnxruntime_providers_cuda.so" "${keep[@]}"
fi
# --x86: the branch filter for x86-64 machine code, 2.5% smaller here
(cd "$work/ort" && tar cf - . | xz -T0 --x86 --lzma2=preset=9e > "$work/onnxruntime-gpu.tar.xz")
mkdir -p "$dir" "$dir-mpi"
rm -f "$dir"/onnxruntime-gpu.tar.xz.part-* "$dir"/mpich-*.whl "$dir"/mpi4py-*.whl "$dir"/onnx2fx-*.whl \
    "$dir-mpi"/*.whl
split -b "${part_mib}M" -d "$work/onnxruntime-gpu.tar.xz" "$dir/onnxruntime-gpu.tar.xz.part-"
mv "$work"/onnx2fx-*.whl "$dir/"
mv "$work"/mpich-*.whl "$work"/mpi4py-*.whl "$dir-mpi/"
cp "$here/gpu_install.sh" "$dir/install.sh"
if command -v "${NVCC:-nvcc}" >/dev/null; then
    rm -f "$dir/libort_trainer_kernels.so" "$dir/libort_trainer_kernels.so.xz"
    "${KERNELS_PYTHON:-$python}" -c "import sys; from pathlib import Path; from ort_trainer.kernels import build
build(Path(sys.argv[1]), cuda=True)" "$dir"
    xz -9e "$dir/libort_trainer_kernels.so"
else
    echo "gpu_wheels: no nvcc here: the GPU machine builds ort_trainer's kernel library itself (or needs nvcc)" >&2
fi
(cd "$dir" && md5sum onnxruntime-gpu.tar.xz.part-* > parts.md5)
ls -l "$dir" "$dir-mpi"
du -sh "$dir" "$dir-mpi"
