"""ORTTrainerOptions and optimizer configs: typed, validated, every problem reported with its path."""

import math

import pytest

from ort_trainer import ORTTrainerOptions, devices
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.optim import AdamConfig, DecayMode, LambConfig, SGDConfig
from ort_trainer.optim.lr_scheduler import LinearWarmupLRScheduler

API_KEYS = {
    "batch.gradient_accumulation_steps", "device.id", "device.mem_limit", "distributed.world_rank",
    "distributed.world_size", "distributed.local_rank", "distributed.allreduce_post_accumulation",
    "distributed.deepspeed_zero_optimization.stage", "lr_scheduler", "mixed_precision.enabled",
    "mixed_precision.loss_scaler", "utils.frozen_weights", "utils.grad_norm_clip",
    "debug.deterministic_compute", "debug.check_model_export",
    "debug.graph_save_paths.model_after_graph_transforms_path",
    "debug.graph_save_paths.model_with_gradient_graph_path",
    "debug.graph_save_paths.model_with_training_graph_path", "_internal_use.extra_postprocess",
    "_internal_use.onnx_opset_version", "session_options", "provider_options",
}
OUR_KEYS = {  # ort_trainer's own additions: the speed passes, each can be turned off
    "graph_optimizations.shape_specialization", "graph_optimizations.max_shape_graphs",
    "graph_optimizations.sparse_labels", "graph_optimizations.cross_entropy", "graph_optimizations.embedding_gradient",
    "graph_optimizations.fast_gelu_gradient", "graph_optimizations.integer_powers", "graph_optimizations.gelu",
    "graph.gradient_source",
    "graph_optimizations.host_dropout_masks", "graph_optimizations.dropout_gradient", "graph_optimizations.sequences",
    "graph_optimizations.output_reshape",
    "graph_optimizations.safe_softmax", "graph_optimizations.unfused_skip_layer_norm",
    "graph_optimizations.column_sums", "graph_optimizations.tied_embedding_gradient",
    "graph_optimizations.transposed_products", "graph_optimizations.activation_recompute",
    "graph_optimizations.device_barriers", "graph_optimizations.seeded_dropout",
    "graph_optimizations.layer_recompute",
    "graph_optimizations.aligned_products", "graph_optimizations.fused_gradient_sums",
    "graph_optimizations.half_precision_attention", "graph_optimizations.half_precision_softmax_gradient",
    "graph_optimizations.half_precision_loss", "graph_optimizations.half_precision_bias_gradient",
    "graph_optimizations.half_precision_transposed_products", "graph_optimizations.half_precision_gelu",
    "graph_optimizations.bfloat16_softmax_gradient", "graph_optimizations.gelu_forward_kernel",
    "graph_optimizations.fused_gelu_gradient", "graph_optimizations.fused_layer_norm_gradient",
    "graph_optimizations.fused_layer_norm",
    "graph_optimizations.fused_softmax_gradient", "graph_optimizations.fused_safe_softmax",
    "graph_optimizations.fused_cross_entropy", "graph_optimizations.fused_attention", "graph_optimizations.fused_lstm",
    "graph_optimizations.packed_attention", "graph_optimizations.causal_attention", "graph_optimizations.integer_pads",
    "graph_optimizations.weight_casts",
    "graph_optimizations.torch_attention_choice",
    "graph_optimizations.torch_products", "graph_optimizations.torch_convolutions",
    "graph_optimizations.torch_batch_norm",
    "graph_optimizations.loss_pieces", "graph_optimizations.loss_piece_elements",
    "distributed.backend",
    "mixed_precision.dtype",
    "graph.optimizer",
    "device.host_threads", "device.cuda_graph", "device.torch_allocator",
}


def test_defaults_cover_the_full_key_set():
    opts = ORTTrainerOptions()
    assert set(opts.flat()) == API_KEYS | OUR_KEYS
    assert opts.batch.gradient_accumulation_steps == 1
    assert opts.device.id == devices.default_device_id()  # cuda with onnxruntime-gpu, a CUDA torch and a GPU
    assert opts.utils.grad_norm_clip is True and opts.utils.frozen_weights == []
    assert opts._internal_use.onnx_opset_version == 17
    assert opts.debug.graph_save_paths.model_with_gradient_graph_path == ""
    assert opts.distributed.deepspeed_zero_optimization.stage == 0
    assert opts.provider_options == {} and opts.session_options is None
    assert "batch.gradient_accumulation_steps = 1" in ORTTrainerOptions.describe()


def test_values_are_read_back_with_attribute_access():
    scheduler = LinearWarmupLRScheduler(total_steps=10, warmup=0.1)
    opts = ORTTrainerOptions({"utils": {"frozen_weights": ["fc1.bias"], "grad_norm_clip": False},
                              "lr_scheduler": scheduler, "provider_options": {"arena_extend_strategy": "x"}})
    assert opts.utils.frozen_weights == ["fc1.bias"]
    assert opts.lr_scheduler is scheduler  # the user's object, not a copy
    assert opts.provider_options == {"arena_extend_strategy": "x"}
    with pytest.raises(AttributeError, match="no option 'nope'"):
        opts.utils.nope


def test_every_problem_is_listed_with_its_path():
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions({
            "batch": {"gradient_accumulation_steps": 0},
            "utils": {"grad_norm_clip": "yes", "frozen_weight": []},
            "debug": {"graph_save_paths": {"model_with_gradient_graph_path": 3}},
            "_internal_use": {"onnx_opset_version": 9},
            "devices": {},
            "session_options": {"intra_op_num_threads": 1},
        })
    message = str(info.value)
    for expected in [
        "batch.gradient_accumulation_steps: must be >= 1, got 0",
        "utils.grad_norm_clip: expected bool, got str 'yes'",
        "utils.frozen_weight: unknown option; known keys here: ['frozen_weights', 'grad_norm_clip']",
        "debug.graph_save_paths.model_with_gradient_graph_path: expected str, got int 3",
        "_internal_use.onnx_opset_version: must be between 14 and 20, got 9",
        "devices: unknown option",
        "session_options: expected an onnxruntime.SessionOptions or None, got dict",
    ]:
        assert expected in message, message


def test_bool_is_not_an_int():
    with pytest.raises(ValueError, match="batch.gradient_accumulation_steps: expected int, got bool True"):
        ORTTrainerOptions({"batch": {"gradient_accumulation_steps": True}})


def test_a_loss_scaler_alone_is_fine():
    # mixed_precision.enabled itself: tests/test_mixed_precision.py
    scaler = DynamicLossScaler()
    assert ORTTrainerOptions({"mixed_precision": {"loss_scaler": scaler}}).mixed_precision.loss_scaler is scaler
    assert ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 4}}).batch.gradient_accumulation_steps == 4


def test_rank_must_be_below_world_size():
    with pytest.raises(ValueError, match=r"distributed.world_rank: 1 must be < distributed.world_size \(1\)"):
        ORTTrainerOptions({"distributed": {"world_rank": 1}})


def test_bad_device_string():
    with pytest.raises(ValueError, match="device.id: expected 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        ORTTrainerOptions({"device": {"id": "gpu"}})


def test_optimizer_configs_expose_arguments_and_reject_unknown_hyperparameters():
    config = AdamConfig(params=[{"params": ["fc1.bias"], "lambda_coef": 0.0, "lr": 0.1}], lr=1e-3, lambda_coef=0.01)
    assert config.lr == 1e-3 and config.alpha == 0.9 and config.beta == 0.999 and config.epsilon == 1e-8
    assert config.max_norm_clip == 1.0 and config.do_bias_correction is True
    assert config.weight_decay_mode is DecayMode.BEFORE_WEIGHT_UPDATE
    assert config.params == [{"params": ["fc1.bias"], "lambda_coef": 0.0, "lr": 0.1}]
    lamb = LambConfig()
    assert lamb.ratio_min == -math.inf and lamb.ratio_max == math.inf and lamb.epsilon == 1e-6
    assert lamb.do_bias_correction is False
    assert SGDConfig().lr == 0.001
    with pytest.raises(ValueError) as info:
        AdamConfig(params=[{"params": ["w"], "momentum": 0.9}, {"params": ["w"], "max_norm_clip": 2.0},
                           {"weights": ["v"]}], alpha=1.5)
    message = str(info.value)
    assert "AdamConfig.alpha: must be in [0, 1), got 1.5" in message
    assert "AdamConfig.params[0].momentum: unknown hyper-parameter for AdamConfig" in message
    assert "AdamConfig.params[1].params: weight 'w' is already in group 0" in message
    assert "AdamConfig.params[1].max_norm_clip: is global to the optimizer and cannot be set per group" in message
    assert "AdamConfig.params[2].params: expected a list of weight names (str)" in message
    with pytest.raises(ValueError, match="SGDConfig.lr: expected int/float, got str"):
        SGDConfig(lr="0.1")


def test_problems_between_options_are_listed_with_the_others():
    """The cross-option checks used to run only when every option was fine on its own."""
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 0}, "device": {"id": "cpu"},
                           "mixed_precision": {"dtype": "float32"}, "distributed": {"world_rank": 5, "world_size": 2}})
    message = str(info.value)
    assert "batch.gradient_accumulation_steps: must be >= 1, got 0" in message
    assert "mixed_precision.dtype: must be one of ['float16', 'bfloat16'], got 'float32'" in message
    assert "distributed.world_rank: 5 must be < distributed.world_size (2)" in message


def test_a_group_given_a_value_and_a_list_given_a_string_say_what_to_write():
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions({"batch": 3, "utils": {"frozen_weights": "fc1.weight", "grad_norm_clp": True},
                           "devce": {}, 7: 1})
    message = str(info.value)
    assert ("batch: expected a group of options (a dict with keys ['gradient_accumulation_steps']), got int 3"
            in message)
    assert "utils.frozen_weights: expected a list, got the str 'fc1.weight'; write ['fc1.weight']" in message
    assert ("utils.grad_norm_clp: unknown option; known keys here: ['frozen_weights', 'grad_norm_clip']; "
            "did you mean 'utils.grad_norm_clip'?") in message
    assert "devce: unknown option; known keys here: [" in message and "did you mean 'device'?" in message
    assert "7: option keys must be str, got int 7" in message
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions({"debug": {"graph_save_paths": "out/"}})
    assert "debug.graph_save_paths: expected a group of options (a dict with keys" in str(info.value)
    assert "known keys here: ['check_model_export', 'deterministic_compute', 'graph_save_paths', " \
           "'graph_save_paths'" not in str(info.value)
