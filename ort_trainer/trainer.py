"""``ORTTrainer``: train a PyTorch model (or an ONNX model with its loss) through ONNX Runtime.

The trainer validates its arguments, drives the graph pipeline once, and then runs every step
through the engine. It keeps the step counters; the math lives in the graphs.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
import torch

from . import distributed
from ._export_check import check_model_export
from ._inputs import StepInputs
from ._interrupt import deferred_interrupt
from ._logging import logger
from ._module_attributes import AttributeWatch, TensorWatch
from ._onnx_files import data_path, save_while_building
from ._pass_switches import pass_switches
from ._runtime import resolve_gradient_source
from ._state import _StateMixin
from .amp.kernels import missing_kernels_explained
from .devices import host_array, host_dtype, host_threads, torch_threads
from .distributed import make_communicator
from .engine import Engine
from .graph.export.input_checks import BatchChecks
from .graph.export.torchscript import training_in_trace
from .graph.gradient import make_gradient_source
from .graph.job import GraphJob
from .graph.onnx_graph import build_inference_graph
from .graph.optimizer import state_names
from .graph.pipeline import TrainingGraphs, build_optimizer, initial_weights
from .graph.shapes import ShapeGraphs
from .model_desc import ModelDescription, parse_model_desc
from .optim.config import _OptimizerConfig, check_learning_rate
from .options import ORTTrainerOptions


class TrainStepInfo:
    """Step state shared with the user (api.md section 2).

    Attributes:
        optimizer_config: the trainer's optimizer config.
        all_finite: False when the last step's gradients had a NaN or inf (its update was skipped).
        fetches: output names the steps return (empty: all of them).
        optimization_step: number of updates applied.
        step: number of ``train_step`` calls.
    """

    def __init__(self, optimizer_config: _OptimizerConfig, all_finite: bool = True, fetches: list | None = None,
                 optimization_step: int = 0, step: int = 0):
        self.optimizer_config = optimizer_config
        self.all_finite = all_finite
        self.fetches = [] if fetches is None else fetches
        self.optimization_step = optimization_step
        self.step = step

    def __repr__(self) -> str:
        return (f"TrainStepInfo(all_finite={self.all_finite}, fetches={self.fetches}, "
                f"optimization_step={self.optimization_step}, step={self.step})")


class ORTTrainer(_StateMixin):
    """Trains a model with ONNX Runtime: forward, loss, backward and optimizer in ONNX graphs.

    Args:
        model: a ``torch.nn.Module``, or an ``onnx.ModelProto`` whose graph computes the loss.
        model_desc: a ``ModelDescription`` or its dict form
            ``{"inputs": [(name, shape)], "outputs": [(name, shape, is_loss)]}``.
        optim_config: ``SGDConfig``, ``AdamConfig`` or ``LambConfig``.
        loss_fn: ``loss_fn(prediction, label)``; None when the model returns the loss. With a
            loss_fn the last input is the label and the outputs are ``(loss, *model_outputs)``.
        options: ``ORTTrainerOptions`` or its dict form; None for defaults.

    Raises:
        TypeError: for an argument of the wrong type.
        ValueError: for a malformed description or options, listing every problem with its path.

    The training graph is built on the first ``train_step``/``eval_step``, or here when every
    input's dtype is given in ``model_desc``; it is cached on disk (``ORT_TRAINER_CACHE_DIR``).
    """

    def __init__(
        self,
        model: torch.nn.Module | onnx.ModelProto,
        model_desc: ModelDescription | Mapping[str, Any],
        optim_config: _OptimizerConfig,
        loss_fn: Callable | None = None,
        options: ORTTrainerOptions | Mapping[str, Any] | None = None,
    ):
        if not isinstance(model, (torch.nn.Module, onnx.ModelProto)):
            raise TypeError(f"model: expected a torch.nn.Module or an onnx.ModelProto, got {type(model).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn: expected a callable or None, got {type(loss_fn).__name__}")
        if isinstance(model, onnx.ModelProto) and loss_fn is not None:
            raise ValueError("loss_fn must be None when model is an ONNX model: the graph must compute the loss")
        if not isinstance(optim_config, _OptimizerConfig):
            raise TypeError(
                f"optim_config: expected SGDConfig, AdamConfig or LambConfig, got {type(optim_config).__name__}"
            )
        # an ONNX model is copied: loading a state before the first step writes its initializers
        self.model = copy.deepcopy(model) if isinstance(model, onnx.ModelProto) else model
        self.loss_fn = loss_fn
        self.model_desc: ModelDescription = parse_model_desc(model_desc)
        if loss_fn is not None and len(self.model_desc.inputs) < 2:
            raise ValueError("model_desc.inputs: with a loss_fn the last input is the label, so at least two are needed")
        self.optim_config = optim_config
        self.options = options if isinstance(options, ORTTrainerOptions) else ORTTrainerOptions(options)
        self._train_step_info = TrainStepInfo(optim_config)
        opts = self.options
        window = opts.batch.gradient_accumulation_steps
        source = make_gradient_source(resolve_gradient_source(opts.graph.gradient_source))
        # a captured step (device.cuda_graph) runs its graph more than once on its first call and must
        # keep its shapes: micro-batches are summed outside it, and every label's row is projected
        captured = opts.device.cuda_graph
        self._job = GraphJob(
            model=model, loss_fn=loss_fn, desc=self.model_desc, optim_config=optim_config,
            frozen_weights=list(opts.utils.frozen_weights), grad_norm_clip=opts.utils.grad_norm_clip,
            opset=opts._internal_use.onnx_opset_version, extra_postprocess=opts._internal_use.extra_postprocess,
            save_paths=dict(opts.debug.graph_save_paths),
            accumulate=window > 1 and not captured and (
                opts.distributed.world_size == 1 or opts.distributed.allreduce_post_accumulation),
            passes=pass_switches(opts),
            source=source,
            autocast=opts.mixed_precision.dtype if opts.mixed_precision.enabled else None,
        )
        dist = opts.distributed
        self._comm = (make_communicator(dist.backend, opts.device.id, dist.world_size, dist.world_rank)
                      if dist.world_size > 1 else None)
        # With several ranks and per-micro-batch all-reduce, micro-batch gradients leave the graph
        # to be all-reduced; they, and those of a source that cannot accumulate inside its graph,
        # are summed on the host.
        self._allreduce_micro_batches = self._comm is not None and window > 1 and not dist.allreduce_post_accumulation
        self._host_accumulation = window > 1 and (self._allreduce_micro_batches or captured
                                                  or not source.accumulates_in_graph)
        self._zero_counts: list[int] | None = None
        self._building_for: tuple | None = None  # (feeds, training) while ``_ready`` may build graphs
        self._shapes = ShapeGraphs(self._job, opts.graph_optimizations.shape_specialization,
                                   opts.graph_optimizations.max_shape_graphs, check_batch=self._check_building)
        self._engine: Engine | None = None
        self._inputs = StepInputs(self.model_desc)
        self._dtypes_of: tuple | None = None  # (graphs, the input dtypes they take)
        self._fetched_of: tuple | None = None  # _fetch_plan's
        self._checks: dict[int, tuple[dict, BatchChecks]] = {}  # id(constraints) -> (constraints, their checks)
        self._pending_optimizer: dict = {}  # optimizer state loaded before the graph existed
        self._counter_base: dict[str, int] = {}  # BatchNorm num_batches_tracked at step 0
        self._attributes: AttributeWatch | None = None  # the model's Python attributes its graphs hold
        self._tensor_watch: TensorWatch | None = None  # the model's tensors, changes the script makes copied
        # Seed of the dropout masks: step k draws its masks from (seed, rank, k) alone, so a
        # resumed run (the seed is checkpointed) draws the masks an uninterrupted run would.
        self._seed = int(torch.initial_seed()) % 2**63
        if all(d.dtype is not None for d in self.model_desc.inputs):
            self._build(self._shapes.synthetic_inputs())

    @property
    def _graphs(self) -> TrainingGraphs | None:
        """The first graphs built (the engine's layout comes from them), or None before."""
        return self._shapes.first

    # ---- building -----------------------------------------------------------------------------
    def _build(self, sample_inputs: Sequence[np.ndarray]) -> None:
        """Build the first graphs (``ShapeGraphs.build_first``) and the engine around them; a user's
        batch (``_ready``'s) is checked against the graphs' input rules as soon as they are known,
        after the trace and before the build (``_check_building``)."""
        if self._comm is not None and self._comm.rank != 0:
            self._comm.barrier()  # rank 0 builds and caches the graph; the others then load it
        graphs = self._shapes.build_first(sample_inputs, self._outputs_key())
        if self._comm is not None and self._comm.rank == 0:
            self._comm.barrier()
        trained = graphs.meta["trained"]
        dist = self.options.distributed
        spec = build_optimizer(self._job, graphs.meta, dist.world_size, dist.world_rank,
                               zero=dist.deepspeed_zero_optimization.stage == 1)
        self._zero_counts = spec.counts
        self._engine = Engine(
            graph_provider=self._shapes.graphs_for,
            weights=initial_weights(self.model, graphs.meta),
            trained=trained,
            state_names=state_names(self.optim_config),
            output_names=self.model_desc.output_names,
            device=self.options.device.id,
            session_options=self.options.session_options,
            provider_options=self.options.provider_options,
            mem_limit=self.options.device.mem_limit,
            torch_allocator=self.options.device.torch_allocator,
            deterministic=self.options.debug.deterministic_compute,
            optimizer_spec=spec,
            optimizer_config=self.optim_config,
            grad_norm_clip=self.options.utils.grad_norm_clip,
            optimizer_implementation=self.options.graph.optimizer,
            host_accumulation=self._host_accumulation,
            intra_op_threads=distributed.intra_op_threads(),
            buffer_updates=graphs.meta.get("buffer_updates", {}),
            unfused_skip_layer_norm=self.options.graph_optimizations.unfused_skip_layer_norm,
            release_weights=self._share_module_memory,
            graph_capture=self.options.device.cuda_graph,
        )
        if self._comm is not None:  # every rank starts from rank 0's weights
            self._comm.broadcast(self._engine.weights_flat[self._engine.parity])
            for tensor in self._engine.fixed_tensors.values():
                self._comm.broadcast(tensor)
        if isinstance(self.model, torch.nn.Module):
            # BatchNorms count batches (InstanceNorm has the counter too, never counting); in eval mode none
            counting = training_in_trace(self.model) & {
                n for n, m in self.model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
            self._counter_base = {k: int(v) - self._train_step_info.step for k, v in self.model.state_dict().items()
                                  if k.endswith("num_batches_tracked") and k.rpartition(".")[0] in counting}
            self._tensor_watch = TensorWatch(self.model, self._graphs.meta["torch_keys"], self._engine,
                                             set(self._graphs.meta["trained"]) | set(self._engine.buffer_updates))
        if self._pending_optimizer:
            self._engine.load_optimizer_states(self._pending_optimizer)
            self._pending_optimizer = {}
        if self.options.debug.check_model_export and isinstance(self.model, torch.nn.Module):
            check_model_export(self.model, self.loss_fn, self.model_desc, self._job.autocast, self._engine,
                               self._shapes.full_signature, sample_inputs)

    def _outputs_key(self) -> tuple | None:
        """The outputs part of a signature: the fetched outputs besides the loss, None for all."""
        return self._fetch_plan()[2]

    def _ready(self, feeds: dict[str, np.ndarray], training: bool = True) -> Engine:
        # sessions are made here, before the step changes anything; the graphs of a new shape are
        # checked against the batch between their trace and their build (``_check_building``)
        if self._attributes is not None:
            self._attributes.check()  # a Python attribute or mode changed since the graphs were traced
        if self._tensor_watch is not None:
            self._tensor_watch.copy_changes()  # a tensor the script changed, where the engine holds a copy
        self._building_for = (feeds, training)
        try:
            with self._kernels_explained():
                if self._engine is None:
                    self._build([feeds[name] for name in self.model_desc.input_names])
                self._engine.select(self._shapes.signature(feeds, self._outputs_key()), training)
        finally:
            self._building_for = None
        if isinstance(self.model, torch.nn.Module):
            self._attributes = self._attributes.current() if self._attributes else AttributeWatch(self.model,
                                                                                                 self.loss_fn)
        if self._tensor_watch is not None:  # a trace of a new shape bumped the versions of what its forward changed
            self._tensor_watch.rebase(None, training)
        return self._engine

    def _check_building(self, constraints: dict) -> None:
        """``ShapeGraphs``' check of graphs about to be built: the batch ``_ready`` builds them for
        (none at construction, whose synthetic batch needs none)."""
        if self._building_for is not None:
            self._check_batch(*self._building_for, constraints)

    def _kernels_explained(self):
        """Mixed precision: a half-precision kernel ONNX Runtime lacks is a ``MissingKernelError``."""
        mixed = self.options.mixed_precision
        return missing_kernels_explained(mixed.dtype if mixed.enabled else None, self.options.device.id)

    # ---- inputs -------------------------------------------------------------------------------
    def _prepare_inputs(self, args: tuple, kwargs: dict) -> dict[str, np.ndarray]:
        return self._inputs.feeds(args, kwargs, self._input_dtypes())

    def _input_dtypes(self) -> dict[str, np.dtype | None]:
        """The dtype each input must have: the built graph's, or model_desc's before (None: any)."""
        graphs = self._graphs
        if self._dtypes_of is None or self._dtypes_of[0] is not graphs:
            meta = graphs.meta["inputs"] if graphs is not None else {}
            self._dtypes_of = (graphs, {d.name: np.dtype(meta[d.name]) if d.name in meta else d.numpy_dtype
                                        for d in self.model_desc.inputs})
        return self._dtypes_of[1]

    def _fetched(self) -> tuple[str, ...]:
        """The output names the steps return (``TrainStepInfo.fetches``, or all)."""
        return self._fetch_plan()[1]

    def _fetch_plan(self) -> tuple:
        """``(fetches, the outputs the steps return, _outputs_key)``, checked once per change of
        ``TrainStepInfo.fetches`` (a list the user may replace or change in place)."""
        fetches = tuple(self._train_step_info.fetches)
        if self._fetched_of is None or self._fetched_of[0] != fetches:
            names = self.model_desc.output_names
            unknown = [f for f in fetches if f not in names]
            if unknown:
                raise ValueError(f"TrainStepInfo.fetches: {unknown} are not outputs of model_desc {names}")
            fetched = fetches or tuple(names)
            key = None if set(fetched) == set(names) else tuple(n for n in fetched if n != self.model_desc.loss_name)
            self._fetched_of = (fetches, fetched, key)
        return self._fetched_of

    def _select_outputs(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        selected = [outputs[name] for name in self._fetched()]
        return selected[0] if len(selected) == 1 else selected

    # ---- steps --------------------------------------------------------------------------------
    def train_step(self, *inputs: Any, **named_inputs: Any) -> torch.Tensor | list[torch.Tensor]:
        """Run one training step: forward, loss, backward and, at an accumulation boundary, the update.

        With ``batch.gradient_accumulation_steps = k`` the gradients of k calls are summed; the k-th
        averages them, clips them and applies the update. A step whose gradients are not all
        finite applies nothing (``TrainStepInfo.all_finite`` is False) and lowers the loss scale.

        Args:
            *inputs: model inputs in ``model_desc`` order (torch tensors or numpy arrays).
            **named_inputs: the same, by name.

        Returns:
            The outputs in ``model_desc`` order (or ``TrainStepInfo.fetches`` order), as torch
            tensors: the tensor itself when there is one.

        Raises:
            ValueError: for missing, unknown or misshapen inputs, and values PyTorch refuses (a label
                or token id out of range, a sequence longer than the position table), before
                anything runs. TypeError: for a wrong dtype.
            StepError: ONNX Runtime failed inside the step (out of memory...); the message names the
                inputs' shapes and the module, and the trainer's state is as before the step.
            RuntimeError: a Python attribute or mode of the model changed since its graphs were traced,
                named, before anything runs (docs/export_limits.md, "Changed after the graphs were built").
        """
        feeds = self._prepare_inputs(inputs, named_inputs)
        self._check_batch(feeds, training=True)  # before a new shape's graph is built
        engine = self._ready(feeds)
        info = self._train_step_info
        window = self.options.batch.gradient_accumulation_steps
        scaler = self.options.mixed_precision.loss_scaler
        loss_scale = scaler.loss_scale if scaler is not None else 1.0
        first, boundary = info.step % window == 0, (info.step + 1) % window == 0
        learning_rates = self._learning_rates() if boundary else None  # checked before any work
        # From here the step changes state: it is applied whole or not at all (Ctrl-C waits).
        threads = host_threads(self.options.device.host_threads, engine.grads_flat.numel())
        with deferred_interrupt():
            with torch_threads(0 if engine.sessions.runs_torch_kernels else threads):  # torch's kernels: its count
                outputs = engine.forward_backward(feeds, loss_scale, reset=first, seed=self._step_seed)
            with torch_threads(threads):
                if self._allreduce_micro_batches:
                    self._comm.allreduce_sum(engine.grads_flat, step=info.step)
                if self._host_accumulation:
                    engine.accumulate_on_host(reset=first)
                if self._comm is not None and boundary and not self._allreduce_micro_batches:
                    self._comm.allreduce_sum(engine.accumulated_flat, step=info.step)
                if boundary:
                    ranks = self._comm.size if self._comm is not None else 1
                    self._update(engine, learning_rates, grad_scale=1.0 / (loss_scale * window * ranks))
                rejected = engine.commit_buffers()
                if rejected:
                    logger.warning("step %d: the new values of %s are not finite (a NaN or inf batch?); they were "
                                   "not updated", info.step, ", ".join(rejected))
                info.step += 1
        return self._select_outputs(outputs)

    def _step_seed(self) -> int:
        """The random seed of this step's dropout masks: a function of (seed, rank, step) only."""
        rank = self._comm.rank if self._comm is not None else 0
        state = np.random.SeedSequence([self._seed, rank, self._train_step_info.step]).generate_state(1, np.uint64)
        return int(state[0] >> np.uint64(1))  # ONNX Runtime takes a signed 64-bit seed

    def _check_batch(self, feeds: dict[str, np.ndarray], training: bool, constraints: dict | None = None) -> None:
        """Refuse values PyTorch would refuse (labels out of range, positions past the table, one
        value per BatchNorm channel...): the rules of ``constraints``, by default those that hold
        for the batch's shapes (``ShapeGraphs.constraints_for``).

        Raises:
            ValueError: listing every problem, before anything runs.
        """
        if constraints is None:
            constraints = self._shapes.constraints_for(feeds)
        if not constraints:
            return
        known = self._checks.get(id(constraints))
        if known is None or known[0] is not constraints:
            known = self._checks[id(constraints)] = (constraints, BatchChecks(constraints))
        checks = known[1]
        # the symbols' sizes only where a rule reads them (BatchNorm's, in training)
        symbols = dict(self._shapes.symbol_sizes(feeds)) if training and checks.needs_symbols else {}
        problems = checks.problems(feeds, symbols, training)
        if problems:
            raise ValueError("bad inputs:\n  " + "\n  ".join(problems))

    def _update(self, engine: Engine, learning_rates: list[float], grad_scale: float) -> None:
        """The optimizer step at an accumulation boundary, and the counters it moves.

        The update is committed only when every gradient and every updated weight is finite
        (on every rank); otherwise weights and optimizer states stay as they were.
        """
        info, update = self._train_step_info, engine.update
        result = update.step(learning_rates, info.optimization_step + 1, grad_scale)
        weights_finite = result.weights_finite
        if self._zero_counts is not None:  # each rank checked only the range it updated
            weights_finite = all(self._comm.allgather_object(weights_finite, step=info.step))
        applied = result.all_finite and weights_finite
        if applied:
            update.commit()
            if self._zero_counts is not None:  # each rank updated its range: share them
                self._comm.allgather(engine.weights_flat[engine.parity], self._zero_counts, step=info.step)
            info.optimization_step += 1
        elif not result.all_finite:
            logger.warning("step %d: gradients are not finite; the update was skipped", info.step)
        else:
            logger.warning("step %d: the update would make weights non-finite (learning rates %s, gradient norm "
                           "%.3g); it was skipped: lower the learning rate", info.step,
                           [f"{lr:.3g}" for lr in learning_rates], result.global_gradient_norm)
        info.all_finite = applied
        scaler = self.options.mixed_precision.loss_scaler
        if scaler is not None:
            scaler.update(info)

    def eval_step(self, *inputs: Any, **named_inputs: Any) -> torch.Tensor | list[torch.Tensor]:
        """Run the forward pass with Dropout off and BatchNorm in inference mode; no state changes.

        Takes and returns the same as ``train_step``, and raises the same errors.
        """
        feeds = self._prepare_inputs(inputs, named_inputs)
        self._check_batch(feeds, training=False)
        engine = self._ready(feeds, training=False)
        with self._kernels_explained():  # the eval session is made on the first evaluation
            return self._select_outputs(engine.evaluate(feeds))

    def _learning_rates(self) -> list[float]:
        """One learning rate per parameter group (group 0: weights in no group).

        Raises:
            ValueError: when a learning rate is not a finite, non-negative float32 number (the
                config may have been changed since construction, or the scheduler produced it).
        """
        config = self.optim_config
        problems = [check_learning_rate(config.lr, "optim_config.lr")]
        problems += [check_learning_rate(g["lr"], f"optim_config.params[{i}].lr")
                     for i, g in enumerate(config.params) if "lr" in g]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError("invalid learning rate:\n  " + "\n  ".join(problems))
        base = float(config.lr)
        factor = 1.0
        scheduler = self.options.lr_scheduler
        if scheduler is not None:
            value = scheduler._step(self._train_step_info.optimization_step, base)
            problem = check_learning_rate(value, f"the learning rate from {type(scheduler).__name__}")
            if problem:
                raise ValueError(problem)
            factor = value / base if base else 0.0
        return [base * factor] + [float(g.get("lr", base)) * factor for g in config.params]

    # ---- weights and export -------------------------------------------------------------------
    def _require_built(self, what: str) -> Engine:
        if self._engine is None:
            raise RuntimeError(
                f"{what} needs the training graph, which is built on the first train_step/eval_step "
                "(or at construction when model_desc gives every input's dtype)"
            )
        return self._engine

    def save_as_onnx(self, path: str | os.PathLike, external_data: bool | None = None) -> None:
        """Write an inference ONNX model with the current weights (no Dropout, BatchNorm in eval mode).

        Its inputs are the model's own (a label read only by ``loss_fn`` is dropped) and its outputs
        the model's own, named as in the description; it loads in a stock InferenceSession. The
        weights are written one at a time, never all copied at once, while the graph is made.

        Args:
            path: the ``.onnx`` file.
            external_data: True puts the weights in ``<path>.data`` next to it (ONNX's external
                data: ``onnx.load`` and ONNX Runtime read it from the model's directory), False in
                the model file; None (the default) does the first only for a model over protobuf's
                2 GB limit on one file.

        Raises:
            FileNotFoundError: when the directory of ``path`` does not exist.
            RuntimeError: before the graph is built, or where a Python attribute or mode of the model changed
                since (docs/export_limits.md, "Changed after the graphs were built").
            ValueError: ``external_data=False`` for a model over 2 GB.
            OSError: the write failed (a full disk): the message names the file; a file already at
                ``path`` is left as it was.
            KeyboardInterrupt: Ctrl-C during the save: no file is written, or the file is whole
                when the signal came after its last weight.
        """
        path = Path(path)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"save_as_onnx: directory {str(path.parent)!r} does not exist")
        engine = self._require_built("save_as_onnx")
        if self._attributes is not None:
            self._attributes.check()  # the saved graph is the eval graph the trace made
        if self._comm is not None and self._comm.rank != 0:
            return  # under mpirun only rank 0 writes
        desc = self.model_desc
        inputs, outputs = desc.input_names, desc.output_names
        if self.loss_fn is not None:
            inputs = inputs[:-1]
            outputs = [n for n in outputs if n != desc.loss_name]
        tensors = engine.current_tensors()
        specs = {name: (tuple(tensor.shape), host_dtype(tensor)) for name, tensor in tensors.items()}
        external = save_while_building(
            # an export first frees what ONNX Runtime's arena holds idle: the export stack's imports fit there
            lambda: build_inference_graph(self._shapes.symbolic_eval_graph(engine.placement.release_idle_memory),
                                          inputs, outputs, tensors),
            path, specs, lambda name: host_array(tensors[name]), external_data=external_data,
            early=[name for name in tensors if name not in engine.fixed_tensors])  # the trained weights
        logger.info("save_as_onnx: wrote %s%s", path, f" and its weights in {data_path(path)}" if external else "")


__all__ = ["ORTTrainer", "TrainStepInfo"]
