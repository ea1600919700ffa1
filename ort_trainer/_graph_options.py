"""The ``graph_optimizations.*`` options of ``ORTTrainerOptions`` (``options.py``): the graph passes' switches,
each with its default and one line of documentation (docs/usage.md's table says more)."""

from __future__ import annotations

from ._option_fields import _BOOL, _INT, _Field, _at_least

GRAPH_OPTIMIZATIONS: dict[str, _Field] = {
    "graph_optimizations.shape_specialization": _Field(
        _BOOL, True, "build static-shape graphs for the first input-shape signatures seen (see max_shape_graphs)"
    ),
    "graph_optimizations.max_shape_graphs": _Field(
        _INT, 4, "at most this many shape-specialised graph sets; further shapes use the symbolic graph",
        _at_least(1),
    ),
    "graph_optimizations.sparse_labels": _Field(
        _BOOL, True, "when the logits are not fetched, project only the rows whose label is not ignored (padded "
        "to one of four sizes per power of two, so that ONNX Runtime's arena meets few sizes)"
    ),
    "graph_optimizations.cross_entropy": _Field(
        _BOOL, True, "SoftmaxCrossEntropyLoss as LogSoftmax + GatherElements, with an elementwise LogSoftmax gradient"
    ),
    "graph_optimizations.embedding_gradient": _Field(
        _BOOL, True, "embedding (2-D Gather) gradients as one ScatterElements(add) instead of GatherGrad; with the "
        "'torch' source, identity Transposes around them dropped and tables of at most 64 rows as a one-hot product"
    ),
    "graph_optimizations.tied_embedding_gradient": _Field(
        _BOOL, True, "a table both looked up and multiplied by (a tied input and output embedding): the graph writes "
        "the product's gradient into the gradient buffer and the engine adds the lookup's rows into it "
        "(index_add_), instead of the graph scattering them into a zero table and adding the two, which holds two "
        "temporaries the size of the table (GPT-2 small: 154 MB each) (gradient source 'torch' only)"
    ),
    "graph_optimizations.fast_gelu_gradient": _Field(
        _BOOL, True, "tanh-GELU gradient in elementwise operators instead of the FastGeluGrad kernel"),
    "graph_optimizations.integer_powers": _Field(
        _BOOL, True, "x**2 and x**3 as multiplications instead of Pow (a tanh-GELU written out in Python, when the "
        "gelu pass is off; gradient source 'torch' only)"),
    "graph_optimizations.integer_pads": _Field(
        _BOOL, True, "a constant-mode Pad of an integer tensor (the labels Hugging Face's causal-LM loss pads) as a "
        "Concat with constant fills: ONNX Runtime's CUDA provider has no integer Pad, which ran on the host with "
        "copies inside each run (gradient source 'torch' only)"),
    "graph_optimizations.gelu": _Field(
        _BOOL, True, "GELU (F.gelu, or the tanh/erf formula written out as GPT-2's and BERT's Python code "
        "does) with forward and backward computed together, the forward keeping what the backward reads: "
        "13 elementwise nodes per tanh-GELU instead of 21, 11 per erf-GELU instead of 16 (gradient source "
        "'torch' only)"
    ),
    "graph_optimizations.half_precision_gelu": _Field(
        _BOOL, True, "with gelu, mixed precision: a half GELU's forward and backward in its own dtype (torch source)"),
    # regions as kernels of ort_trainer's own library (ort_trainer/kernels; usage.md "ort_trainer's kernels")
    "graph_optimizations.fused_gelu_gradient": _Field(_BOOL, False, "with gelu: each GELU's backward as one kernel"),
    "graph_optimizations.fused_layer_norm_gradient": _Field(
        _BOOL, False, "each LayerNorm's backward as one kernel (a pre-norm one's with the residual's gradient sum)"),
    "graph_optimizations.fused_layer_norm": _Field(
        _BOOL, False, "mixed precision: a float32 LayerNorm whose output half products read as one kernel that "
        "writes the half output (no float32 output and cast; both where others read the float32 output too)"),
    "graph_optimizations.fused_softmax_gradient": _Field(_BOOL, False, "a softmax's backward as one kernel"),
    "graph_optimizations.fused_safe_softmax": _Field(_BOOL, False, "attention's safe softmax as one kernel"),
    "graph_optimizations.fused_cross_entropy": _Field(_BOOL, False, "a cross-entropy as two kernels, no float32 copy"),
    "graph_optimizations.fused_attention": _Field(
        _BOOL, False, "each scaled_dot_product_attention as torch's fused attention kernels, forward and backward"),
    "graph_optimizations.fused_lstm": _Field(
        _BOOL, True, "on the CPU, with the 'torch' source: each nn.LSTM layer and direction (a padded float32 batch, "
        "no projections) as one operator running oneDNN's LSTM kernels as eager PyTorch does, forward and backward, "
        "instead of the recurrence unrolled over the sequence, which also lets the sequence length stay symbolic"),
    "graph_optimizations.torch_convolutions": _Field(
        _BOOL, True, "on the CPU, with the 'torch' source: where every convolution is a float32 one (transposed too), "
        "each convolution and its backward (input and weight gradients), and each ReLU's gradient, as operators "
        "running oneDNN's and torch's kernels as eager PyTorch does, where ONNX Runtime computed the weight's "
        "gradient as a convolution 2.6-3.4x slower"),
    "graph_optimizations.torch_batch_norm": _Field(
        _BOOL, True, "on the CPU, with the 'torch' source: where every batch norm is a float32 one in training with "
        "weight, bias and running statistics, each one and its backward as one operator each running torch's "
        "kernels as eager PyTorch does, where ONNX wrote them as about 35 element-wise nodes and reductions"),
    "graph_optimizations.packed_attention": _Field(
        _BOOL, False, "with fused_attention: q, k and v that one projection packed (GPT-2's) read and their "
        "gradients written where they lie, no Split and Concat copies"),
    "graph_optimizations.causal_attention": _Field(
        _BOOL, False, "with fused_attention: a mask that holds the causal triangle (GPT-2's, with its padding) "
        "computed in the kernel, which skips the scores above the diagonal, and only the rest added as a bias"),
    "graph_optimizations.torch_attention_choice": _Field(
        _BOOL, False, "with fused_attention, on CUDA: each attention runs the kernel torch's own attention picks for "
        "its tensors (cuDNN's, or flash attention without a bias), not always the memory-efficient one"),
    "graph_optimizations.torch_products": _Field(
        _BOOL, False, "each Gemm and MatMul run by torch's BLAS (on a GPU cuBLAS, a bias vector added in the "
        "product's epilogue instead of written into the output first; on the CPU MKL, slower than ONNX Runtime's own "
        "products inside a run); a half product that only a Cast to float32 reads (a weight's gradient) writes "
        "float32 itself, no half copy and Cast; off until a GPU measurement shows it wins"),
    "graph_optimizations.host_dropout_masks": _Field(
        _BOOL, True, "on the CPU, each static-shape training Dropout as x · m with the mask m drawn on the host "
        "(NumPy's PCG64, 16-bit draws, from the step's seed) instead of by ONNX Runtime's Dropout kernel, which "
        "draws 4.6 ns per element on one thread (20-25 ms of the GPT-2-like step; the host takes ~6 ms) and "
        "costs one float per masked element of host memory (18 MB on the GPT-2-like model) (gradient source "
        "'torch' only; GPU graphs keep ONNX Runtime's Dropout)"
    ),
    "graph_optimizations.dropout_gradient": _Field(
        _BOOL, True, "an attention dropout's backward (grad · mask · scale, then · the softmax output) as grad · "
        "the dropout's forward output, three passes over the attention scores fewer; other dropouts' mask · scale "
        "as one DequantizeLinear of the mask cast to bytes (gradient source 'torch' only)"
    ),
    "graph_optimizations.sequences": _Field(
        _BOOL, True, "split outputs (GPT-2's q/k/v) read directly instead of through a tensor sequence, which "
        "copies every tensor twice (gradient source 'torch' only)"
    ),
    "graph_optimizations.output_reshape": _Field(
        _BOOL, True, "a matrix product reshaped into a graph output (GPT-2's logits) computed in the output's shape, "
        "so ONNX Runtime does not copy it (gradient source 'torch' only)"
    ),
    "graph_optimizations.safe_softmax": _Field(
        _BOOL, True, "the fully-masked-row guard of scaled_dot_product_attention's softmax (rows of -inf give 0) "
        "from two row reductions and one Where instead of five passes over the attention scores and a Where "
        "with a full-size zero tensor; bit-equal, NaN rows stay NaN (gradient source 'torch' only)"
    ),
    "graph_optimizations.half_precision_attention": _Field(
        _BOOL, True, "under mixed precision, scaled_dot_product_attention computed in the half dtype (float16 or "
        "bfloat16 products, scores and softmax, as the attention written out in Python runs under autocast) instead "
        "of torch's math attention, which upcasts the inputs and every [batch, heads, seq, seq] tensor to float32 "
        "(gradient source 'torch' only)"
    ),
    "graph_optimizations.loss_pieces": _Field(_BOOL, True, "when the logits are not fetched, a cross-entropy over "
        "a projection with more than loss_piece_elements logits computed in pieces of rows, each piece's backward "
        "right after its forward: none past 2^31 elements, one piece's alive at a time (gradient source 'torch' only)"),
    "graph_optimizations.loss_piece_elements": _Field(_INT, 2**26, "most logits of one loss piece", _at_least(1)),
    "graph_optimizations.half_precision_softmax_gradient": _Field(
        _BOOL, True, "a float16 softmax's gradient (the half-precision attention's) computed in float16, the row sum "
        "accumulated in float32 on CUDA, instead of torch's float32 decomposition between casts: four passes over the "
        "[batch, heads, seq, seq] probabilities instead of seven (gradient source 'torch' only)"
    ),
    "graph_optimizations.bfloat16_softmax_gradient": _Field(
        _BOOL, False, "half_precision_softmax_gradient for bfloat16 softmaxes: the gradient in bfloat16, its row sum "
        "a product by a column of ones that accumulates in float32 (ONNX Runtime's CUDA provider has no bfloat16 "
        "ReduceSum), instead of torch's float32 decomposition between casts: GPT-2 small at 8 x 512 moves ~10 GB "
        "fewer a step. Off by default until a GPU measurement shows it wins (gradient source 'torch' only)"),
    "graph_optimizations.half_precision_loss": _Field(
        _BOOL, False, "under mixed precision, a float32 cross-entropy over half-precision scores (autocast's, and "
        "Hugging Face's logits.float()) computed in the scores' dtype: log-softmax and softmax kernels that "
        "accumulate in float32 and round once, instead of five float32 copies of the [tokens, vocabulary] scores "
        "(GPT-2 small at 8 x 512: 823 MB each, one of them held from the forward to the backward). Each row's "
        "log-probability is rounded to the half dtype before the mean. Off by default until a GPU measurement "
        "shows it wins (gradient source 'torch' only)"
    ),
    "graph_optimizations.half_precision_bias_gradient": _Field(
        _BOOL, False, "under mixed precision, a half-precision product's bias gradient (torch's float32 sum over the "
        "rows of the half output's gradient, cast back to the half dtype) as one half-precision MatMul by ones, "
        "which accumulates in float32 and rounds once: no float32 copy of the gradient (GPT-2 small at 8 x 512: "
        "113 MB a layer). Off by default until a GPU measurement shows it wins (gradient source 'torch' only)"
    ),
    "graph_optimizations.column_sums": _Field(
        _BOOL, True, "sums over the leading axes of a static-shape tensor (bias and LayerNorm weight gradients) as a "
        "matrix product by ones, which ONNX Runtime's CPU kernels run in about half the time of ReduceSum "
        "(gradient source 'torch' only)"
    ),
    "graph_optimizations.transposed_products": _Field(
        _BOOL, True, "a 2-D Transpose read by a MatMul or Gemm folded into a Gemm's transA/transB, so that ONNX "
        "Runtime does not fuse it into a node it runs last: each weight gradient is computed where the backward "
        "reaches it and the layer input it reads is freed there (gradient source 'torch' only)"
    ),
    "graph_optimizations.half_precision_transposed_products": _Field(
        _BOOL, False, "transposed_products for the float16 and bfloat16 MatMul nodes of a mixed-precision graph: "
        "ONNX Runtime's own fusion of them (FusedMatMul, CUDA's too) runs last, so every half weight gradient waited "
        "for the end of the backward and kept its layer's input alive until then. Off by default until a GPU "
        "measurement shows it wins (gradient source 'torch' only)"
    ),
    "graph_optimizations.layer_recompute": _Field(
        _BOOL, False, "`torch` source: each transformer sublayer's values that the backward reads recomputed in the "
        "backward from its LayerNorm's input (checkpointing): the forward keeps two tensors a layer, the step runs "
        "the layers' forward twice; on a GPU its Dropouts are seeded_dropout's, whose copies draw the same masks; a "
        "sublayer with a Dropout that ONNX Runtime draws is left as it is"),
    "graph_optimizations.activation_recompute": _Field(
        _BOOL, True, "an activation's values that the backward reads (a GELU's x/sqrt(2), Phi and output) "
        "recomputed in the backward from its input, so the forward keeps one [batch, seq, 4 x hidden] tensor per "
        "GELU instead of three (with transposed_products, peak RSS BERT-base B4xS128 2558 -> 2490 MB); and each "
        "attention's probabilities recomputed there from q and k (one batched product and softmax more per layer: "
        "BERT-base 2445 -> 2412 MB, GPT-2 small 2923 -> 2789 MB), at the cost of re-running those nodes once per "
        "step (gradient source 'torch' only)"
    ),
    "graph_optimizations.device_barriers": _Field(
        _BOOL, True, "on a GPU, each wait of activation_recompute's and layer_recompute's copies for the backward as "
        "one node of ort_trainer's kernel library (AliasAfter: its input's buffer, no copy) instead of a Reshape "
        "whose shape ONNX Runtime would copy to the host every step (a wait for the GPU each recomputed layer, and "
        "no device.cuda_graph capture); needs the kernel library's CUDA kernels (nvcc, or "
        "$ORT_TRAINER_KERNELS_LIBRARY), without which the waits stay Reshapes (gradient source 'torch' only)"
    ),
    "graph_optimizations.seeded_dropout": _Field(
        _BOOL, True, "on a GPU with device.cuda_graph or layer_recompute, each training Dropout (float32, float16, "
        "bfloat16) as one node of ort_trainer's kernel library (SeededDropout: Philox draws from a seed the trainer "
        "writes to the device every step, a function of (seed, rank, step)), so that a replayed CUDA graph draws new "
        "masks each step and layer_recompute's copies draw the forward's; without it a captured step with dropout is "
        "refused and layer_recompute leaves sublayers with dropout as they are. Needs the kernel library's CUDA "
        "kernels (nvcc, or $ORT_TRAINER_KERNELS_LIBRARY) (gradient source 'torch' only)"
    ),
    "graph_optimizations.aligned_products": _Field(
        _BOOL, False, "matrix products with a static dimension of 1024 or more that is not a multiple of 8 (a "
        "50257- or 30522-word vocabulary's language-model head, forward and backward) computed on operands padded "
        "with zeros to a multiple of 64, the result sliced back: the 16-byte aligned rows that Hopper's tensor-core "
        "kernels need (with fused_cross_entropy, its kernels read the padded logits and write their gradient padded, "
        "no sliced or padded copy). The same values; off by default until a GPU measurement shows it wins there (on the CPU it "
        "only adds copies) (gradient source 'torch' only)"
    ),
    "graph_optimizations.fused_gradient_sums": _Field(
        _BOOL, False, "mixed precision: each float32 sum of a half-precision gradient (an Add of a Cast to float32: a "
        "weight read by several half products, as GPT-2's tied embedding with loss_pieces) as one AddHalf node of "
        "ort_trainer's kernels, the half tensor widened as it is read (no float32 copy; where it is a padded "
        "product's leading rows, the padded product read directly); the same values. Off by default until a GPU "
        "measurement shows it wins (gradient source 'torch' only)"),
    "graph_optimizations.weight_casts": _Field(
        _BOOL, False, "mixed precision: the weights' half copies (a Cast each) by one node of ort_trainer's kernels "
        "(on CUDA a launch per 64 weights; aligned_products' padded weights written padded); the same values. Off "
        "until a GPU measurement shows it wins (gradient source 'torch' only)"),
    "graph_optimizations.gelu_forward_kernel": _Field(
        _BOOL, False, "each GELU's forward, once its backward recomputes its values (activation_recompute), as one "
        "com.microsoft FastGelu (tanh) or BiasGelu with a zero bias (erf) node instead of five or six element-wise "
        "passes; off by default until a GPU measurement shows it wins (on the CPU the kernel is slower) (gradient "
        "source 'torch' only)"
    ),
    "graph_optimizations.unfused_skip_layer_norm": _Field(
        _BOOL, True, "on the CPU, ONNX Runtime's SkipLayerNormFusion is turned off: its SkipLayerNormalization "
        "kernel took 0.7 ms per [1024, 256] against 0.2 ms for the Add and LayerNormalization it replaces (the "
        "BERT-like eval graph; the gradient graphs have no such pattern)"
    ),
}
