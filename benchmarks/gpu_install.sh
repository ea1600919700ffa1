#!/usr/bin/env bash
# On the GPU machine, with every file `make gpu-wheels` wrote gathered in one folder DIR: checks and
# joins the parts, installs onnxruntime-gpu and onnx2fx into PREFIX/site, mpich and mpi4py under
# PREFIX/mpich, removes the CPU onnxruntime the machine's Python may have (it ships the same module),
# and writes PREFIX/env.sh, which puts all of them first. Then, in the checkout:
#   source PREFIX/env.sh && make gpu-check GPU_PYTHON=python3
# Usage: install.sh [DIR (this script's folder)] [PREFIX (/tmp/gpu-site)]
set -euo pipefail
dir=${1:-$(dirname "$0")}
prefix=${2:-/tmp/gpu-site}
python=${PYTHON:-python3}
(cd "$dir" && md5sum -c --quiet parts.md5)
mkdir -p "$prefix/site"
cat "$dir"/onnxruntime-gpu.tar.xz.part-* | xz -d -T0 | tar x -C "$prefix/site"
"$python" -m pip uninstall -y -q onnxruntime 2>/dev/null || true
"$python" -m pip install -q --no-index --no-deps --target "$prefix/site" "$dir"/onnx2fx-*.whl
"$python" -m pip install -q --no-index --no-deps --prefix "$prefix/mpich" "$dir"/mpich-*.whl "$dir"/mpi4py-*.whl
site=$("$python" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
cat > "$prefix/env.sh" <<ENV
export PATH=$prefix/mpich/bin:\$PATH LD_LIBRARY_PATH=$prefix/mpich/lib MPI4PY_LIBMPI=$prefix/mpich/lib/libmpi.so.12
export PYTHONPATH=$prefix/site:$prefix/mpich/lib/$site/site-packages:\$PWD PYTHONUNBUFFERED=1
ENV
if [ -f "$dir/libort_trainer_kernels.so" ]; then  # built where the wheels were gathered (ort_trainer/kernels)
    cp "$dir/libort_trainer_kernels.so" "$prefix/"
    echo "export ORT_TRAINER_KERNELS_LIBRARY=$prefix/libort_trainer_kernels.so" >> "$prefix/env.sh"
fi
echo "installed; now: source $prefix/env.sh"
