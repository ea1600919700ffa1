#!/usr/bin/env bash
# A GPU machine's whole first visit in one command (docs/gpu.md, "One command on a GPU machine"), from the
# checkout, with the folder `make gpu-wheels` wrote beside it:
#   bash benchmarks/gpu_session.sh OUT [BUDGET (570 s)]
# 1. the GPU, its driver (ort_trainer's kernel library is a CUDA 13 build: a 580+ driver) and the install
#    (WHEELS, .gpu-wheels by default: install.sh into /tmp/gpu-site; an empty WHEELS uses the environment as it is);
# 2. `benchmarks/gpu.py --preflight`;
# 3. the cuda tests (TESTS, the GPU kernels' and the levers' by default), stopped after TESTS_S (180) seconds,
#    each test's outcome and what it measured in OUT/cuda-tests.xml;
# 4. benchmarks/gpu_levers.sh into OUT/levers with what BUDGET leaves, less MARGIN (60) seconds for the processes
#    it started last (LEVERS: its second argument; its DEVICE, MODELS, PRECISIONS, ROUNDS, PROBE_ARGS pass on).
# Everything it prints is in OUT/session.log too. Each part runs whatever the one before it did: a failing test
# still leaves the levers measured. Exit status: the tests'.
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT [BUDGET]}
budget=${2:-570}
wheels=${WHEELS-.gpu-wheels}
python=${GPU_PYTHON:-python3}
tests_s=${TESTS_S:-180}
margin=${MARGIN:-60}
tests=${TESTS:-tests/test_placement.py tests/test_kernels.py tests/test_fused_kernels.py tests/test_fused_attention.py \
tests/test_causal_attention.py tests/test_torch_products.py tests/test_aligned_products.py tests/test_gradient_sums.py \
tests/test_layer_norm_sums.py tests/test_layer_norm_forward.py tests/test_weight_casts.py tests/test_cuda_graph.py \
tests/test_torch_allocator.py tests/test_device_barriers.py tests/test_seeded_dropout.py tests/test_cuda.py \
tests/test_ctc.py}
started=$(date +%s)
left() { echo $((budget - ($(date +%s) - started))); }
step() { echo "== $(($(date +%s) - started)) s: $*"; }

session() {
    step "the machine"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'sees',
          torch.cuda.device_count(), 'GPU(s)', torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    if [ -n "$wheels" ]; then
        step "install from $wheels"
        bash "$wheels/install.sh" "$wheels" /tmp/gpu-site || { echo "gpu_session: the install failed"; return 2; }
        # shellcheck disable=SC1091
        source /tmp/gpu-site/env.sh
    fi
    step "preflight"
    "$python" benchmarks/gpu.py --preflight
    step "cuda tests, $tests_s s at most"
    # an interrupt, as Ctrl-C would: pytest reports the tests run so far, in the XML too
    # shellcheck disable=SC2086  # tests: several paths
    timeout -s INT -k 20 "$tests_s" "$python" -m pytest -q -m cuda -rs -p no:cacheprovider $tests \
        --junitxml="$out/cuda-tests.xml"
    status=$?
    [ "$status" -eq 124 ] && echo "gpu_session: the tests ran out of their $tests_s s"
    local deadline=$(($(left) - margin))
    step "levers, $deadline s"
    DEADLINE=$deadline bash benchmarks/gpu_levers.sh "$out/levers" ${LEVERS:+"$LEVERS"}
    step "done"
    return "$status"
}

mkdir -p "$out"
session 2>&1 | tee "$out/session.log"
exit "${PIPESTATUS[0]}"
