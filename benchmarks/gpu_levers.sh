#!/usr/bin/env bash
# One GPU run that measures the step-time levers, A/B in one process order (docs/gpu.md, "Measuring a
# lever"). In an environment where `make gpu-check` runs (docs/gpu.md), from the checkout:
#   bash benchmarks/gpu_levers.sh [OUT (docs/gpu_levers)] [LEVERS (the eighteen graph levers below together with
#       fused_attention, packed_attention, causal_attention and loss_pieces, the same with device.cuda_graph, the
#       eighteen with loss_pieces and device.cuda_graph, the first with torch_attention_choice, then
#       device.cuda_graph,fused_attention,
#       fused_attention+packed_attention,fused_attention+packed_attention+causal_attention,
#       device.torch_allocator,loss_pieces,layer_recompute+device_barriers,
#       activation_recompute,activation_recompute+device_barriers,activation_recompute+device_barriers+
#       gelu_forward_kernel,fused_gelu_gradient,fused_layer_norm_gradient,
#       fused_softmax_gradient,fused_safe_softmax,fused_cross_entropy,half_precision_gelu,bfloat16_softmax_gradient,
#       aligned_products,half_precision_loss,half_precision_bias_gradient,half_precision_transposed_products,
#       fused_gradient_sums,fused_layer_norm,torch_products,weight_casts, each alone: the candidates for the
#       defaults)]
# 1. benchmarks/gpu_probe.py: the language-model head's three products at 4096 × 768 × 50257 and × 50304
#    (and two aligned products of the step; each forward with a bias vector too) in torch and ONNX Runtime:
#    kernel names, ms, TFLOP/s.
# 2. ort_trainer's GPT-2 small and BERT-base steps in fp16 and bf16, without the levers and with each one
#    (LEVERS: comma-separated graph_optimizations names, device.X for a device option; a+b turns two on
#    together), and PyTorch's (REFERENCES: autocast eager and torch.compile by default, measured right after
#    ort_trainer without the levers, so that every setting's row has the goals' ratios from the same run),
#    every setting once per round in alternating order, 2 rounds, round 1 profiled by kind of
#    kernel (benchmarks/gpu.py --impls ort,eager,compile,ort+LEVER,...: OUT/levers.jsonl and its page
#    OUT/levers.md).
# Each part writes its JSON lines as they come (a run cut short keeps what it measured). DEADLINE (seconds,
# default 600) stops starting new processes; the lever part is skipped when the probe used it up.
# DEVICE, MODELS, PRECISIONS, ROUNDS, REFERENCES and PROBE_ARGS change what runs (make test runs it on the CPU at
# toy size).
set -uo pipefail
out=${1:-docs/gpu_levers}
# each lever alone, then the graph levers all together with loss_pieces (what turning every one on would give),
# and with the step captured as a CUDA graph (the host's part of a step gone once the kernels are few and short)
all_graph=activation_recompute+device_barriers+gelu_forward_kernel+fused_gelu_gradient+fused_layer_norm_gradient+fused_softmax_gradient+fused_safe_softmax+fused_cross_entropy+half_precision_gelu+bfloat16_softmax_gradient+aligned_products+half_precision_loss+half_precision_bias_gradient+half_precision_transposed_products+fused_gradient_sums+fused_layer_norm+torch_products+weight_casts
# (loss_pieces and activation_recompute are on by default: each one's row against the others' baseline, where
# both are off, measures it; recompute trades a step's time for memory, which a GPU may not need.
# gelu_forward_kernel acts on the values recompute copies: its row has both, against recompute's row)
# (device_barriers acts on recompute's waits: its row has both, against recompute's row, whose waits the host reads)
graph_levers=${all_graph//+/,}
graph_levers=${graph_levers/activation_recompute,device_barriers,gelu_forward_kernel/activation_recompute,activation_recompute+device_barriers,activation_recompute+device_barriers+gelu_forward_kernel}
# (the three settings with every lever first, then every lever with torch's choice of attention kernel (cuDNN's on
# Hopper; apart: a kernel not run here before), the CUDA graph and fused_attention: a run cut short by DEADLINE,
# which a GPT-2 round of every setting outlasts, measures those first)
every=$all_graph+fused_attention+packed_attention+causal_attention+loss_pieces
attention=fused_attention+packed_attention
levers=${2:-$every,$every+device.cuda_graph,$all_graph+loss_pieces+device.cuda_graph,$every+torch_attention_choice,device.cuda_graph,fused_attention,$attention,$attention+causal_attention,device.torch_allocator,loss_pieces,layer_recompute+device_barriers,$graph_levers}
python=${GPU_PYTHON:-python3}
deadline=${DEADLINE:-600}
device=${DEVICE:-cuda}
started=$(date +%s)
mkdir -p "$out"
# shellcheck disable=SC2086  # PROBE_ARGS: several arguments
"$python" benchmarks/gpu_probe.py --device "$device" ${PROBE_ARGS:-} --results "$out/probe.jsonl" > "$out/probe.md"
references=${REFERENCES-eager,compile}
impls=ort${references:+,$references}
off=""  # every lever named, off: each row carries the whole setting
for lever in ${levers//,/ }; do
    impls="$impls,ort+$lever"
    for pass in ${lever//+/ }; do
        case "$off" in *"\"$pass\""*) ;; *) off="$off${off:+, }\"$pass\": false" ;; esac
    done
done
left=$((deadline - ($(date +%s) - started)))
if [ "$left" -le 30 ]; then
    echo "gpu_levers: deadline reached after the probe; no lever measured" >&2
    exit 0
fi
"$python" benchmarks/gpu.py --device "$device" --models "${MODELS:-gpt2,bert-base}" \
    --precisions "${PRECISIONS:-fp16,bf16}" --impls "$impls" --warm-impls ort,compile --rounds "${ROUNDS:-2}" \
    --warm-parallel 6 --probe '' --profile-steps 3 --deadline "$left" --ort-optimizations "{$off}" \
    --results "$out/levers.jsonl" --out "$out/levers.md" \
    || true  # exit 1 means a goal missed: the page is written all the same
