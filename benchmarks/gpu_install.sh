#!/usr/bin/env bash
# On the GPU machine, with the files `make gpu-wheels` wrote into DIR gathered in one folder: checks and
# joins the parts, installs onnxruntime-gpu and onnx2fx into PREFIX/site, removes the CPU onnxruntime the
# machine's Python may have (it ships the same module), and writes PREFIX/env.sh, which puts all of them
# first. mpich and mpi4py (for the cuda tests of several ranks alone) are installed under PREFIX/mpich
# when their wheels are in DIR or in DIR-mpi (MPI_WHEELS names another folder). Then, in the checkout:
#   source PREFIX/env.sh && make gpu-check GPU_PYTHON=python3
# Usage: install.sh [DIR (this script's folder)] [PREFIX (/tmp/gpu-site)]
set -euo pipefail
dir=${1:-$(dirname "$0")}
dir=${dir%/}
prefix=${2:-/tmp/gpu-site}
python=${PYTHON:-python3}
(cd "$dir" && md5sum -c --quiet parts.md5)
mkdir -p "$prefix/site"
cat "$dir"/onnxruntime-gpu.tar.xz.part-* | xz -d -T0 | tar x -C "$prefix/site"
"$python" -m pip uninstall -y -q onnxruntime 2>/dev/null || true
"$python" -m pip install -q --no-index --no-deps --target "$prefix/site" "$dir"/onnx2fx-*.whl
site=$("$python" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
echo "export PYTHONPATH=$prefix/site:\$PWD PYTHONUNBUFFERED=1" > "$prefix/env.sh"
mpi=${MPI_WHEELS:-$dir-mpi}
mpi_from=""
for wheels in "$dir" "$mpi"; do
    if compgen -G "$wheels/mpich-*.whl" >/dev/null && compgen -G "$wheels/mpi4py-*.whl" >/dev/null; then
        "$python" -m pip install -q --no-index --no-deps --prefix "$prefix/mpich" "$wheels"/mpich-*.whl \
            "$wheels"/mpi4py-*.whl
        cat >> "$prefix/env.sh" <<ENV
export PATH=$prefix/mpich/bin:\$PATH LD_LIBRARY_PATH=$prefix/mpich/lib MPI4PY_LIBMPI=$prefix/mpich/lib/libmpi.so.12
export PYTHONPATH=$prefix/mpich/lib/$site/site-packages:\$PYTHONPATH
ENV
        mpi_from=$wheels
        break
    fi
done
if [ -z "$mpi_from" ]; then
    echo "no mpich and mpi4py wheels in $dir or $mpi: the cuda tests of several ranks will skip (no mpiexec)"
fi
if [ -f "$dir/libort_trainer_kernels.so.xz" ]; then  # built where the wheels were gathered (ort_trainer/kernels)
    xz -dc "$dir/libort_trainer_kernels.so.xz" > "$prefix/libort_trainer_kernels.so"
    echo "export ORT_TRAINER_KERNELS_LIBRARY=$prefix/libort_trainer_kernels.so" >> "$prefix/env.sh"
fi
echo "installed; now: source $prefix/env.sh"
