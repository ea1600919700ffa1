"""ort_trainer against eager PyTorch and torch.compile at the sizes users train: GPT-2 small, BERT-base, a
GPT-2 over protobuf's 2 GB limit, and a compute-bound MLP. Writes docs/benchmarks_real/<CPU kind>.md (the
CPU named in its header: vendor, microarchitecture, the instruction-set extensions that pick GEMM kernels;
``host.py``) and lists it in docs/benchmarks_real.md.

Run: ``make bench-real`` (or ``python benchmarks/real_sizes.py [--models gpt2,bert,gpt2-656m,mlp-1024]``).
Random-init Hugging Face models, dropout 0 (``mlp-1024``: 1024-1024-1024-10 with ReLUs, batch 128,
cross-entropy: its time goes to matrix products), ``AdamConfig(lr=1e-4)`` against
``torch.optim.AdamW`` with ``clip_grad_norm_(1.0)``, the same initial weights and batches. Every measurement is a fresh
process, one implementation each, the order alternating from round to round:

- the first rounds' ort_trainer processes (``COLD_ROUNDS``: 2 for GPT-2 small, BERT-base and the MLP, else 1)
  start from an empty graph cache (their first step is a **cold** build: export, gradient graph, sessions);
  later rounds find the graph in that cache (**warm**);
- each process times ``--steps`` training steps after its first and reports its peak resident
  memory (``ru_maxrss``, the whole process); the losses of both implementations are compared;
- the first rounds (``COMPILE_ROUNDS``) add a ``torch.compile(model)`` process (inductor), trained as
  eager is: its first step compiles, its steps are timed after it; it is not evaluated;
- each process then evaluates 4 batches: eager's model in eval mode under ``torch.no_grad()``
  (the loss and the logits); ort_trainer's ``eval_step`` first with the training loop's
  ``fetches = ["loss"]`` (its first call is its eval graph's first use after the training graph was
  built cold or found in the cache), then with every output (``fetches = []``: graphs of
  a signature of their own; its first call after a cold build is reported); the calls after each
  first are timed, 3 or more, cycling the batches until they add up to ``EVAL_SECONDS``;
- each warm ort_trainer process then times its first ``save_as_onnx``, pointed at an empty graph cache (the
  model's first save ever: it exports the symbolic eval graph), and reports its peak before and after it;
- one more process per row measures the arithmetic ceiling: the step's matrix-product FLOPs
  (``torch.utils.flop_counter`` over one eager forward and backward) and the best float32 GEMM rate
  torch and ONNX Runtime reach on this machine at the row's layer shapes. FLOPs / step time is each
  implementation's rate; the GEMM rate over eager's is the most any implementation could gain over
  eager (a step that only multiplied matrices at the machine's best rate);
- every training process also times torch's float32 product at the row's largest layer shape just before its
  first step (``host_gflops``): the host's matrix-product speed in that minute. The speed-up is given with the
  range of the rounds' own ratios (each round's two processes run back to back), so a round on a slow minute
  shows as one.

``--models`` picks rows; ``--batch`` and ``--seq`` replace their batch and sequence length (the MLP's input
features), to measure at the sizes a user trains (``--models gpt2 --batch 1 --seq 1024``). ``gpt2-656m``
(n_embd 1280, 30 layers: 2.6 GB of weights) needs about 16 GB and 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import host
from real_sizes_report import LOSS_STEPS, page, table, write_index

ROOT = Path(__file__).resolve().parents[1]

# name: (batch, sequence, default steps); gpt2-tiny (2 layers of width 32) is the test's
SIZES = {"gpt2": (4, 128, 3), "bert": (4, 128, 3), "gpt2-656m": (1, 64, 2), "gpt2-tiny": (2, 16, 2),
         "mlp-1024": (128, 1024, 200)}  # (batch, input features, steps)
# Hugging Face config overrides of the rows (and of benchmarks/gpu_worker.py's models) that are not the defaults
_CONFIGS = {"gpt2-656m": {"n_embd": 1280, "n_layer": 30, "n_head": 20},
            "gpt2-tiny": {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 500, "bos_token_id": 0, "eos_token_id": 0},
            "bert-tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                          "vocab_size": 500}}


# fresh processes per implementation and row: this 2-core host's speed drifts by 10-30% from minute to minute (a
# neighbour's load), so a row of short processes takes more of them; the 656 M model's take minutes each
ROUNDS = {"gpt2": 5, "bert": 5, "mlp-1024": 6}
DEFAULT_ROUNDS = 2
# of which the first start from an empty graph cache (a cold build each), at least one round left warm: a single cold
# build's time is the host's speed in that minute as much as the build's
COLD_ROUNDS = {"gpt2": 2, "bert": 2, "mlp-1024": 2}
# torch.compile processes per row, in the first rounds: each first step compiles for about a minute on 2 cores
COMPILE_ROUNDS = {"gpt2": 3, "bert": 3, "mlp-1024": 3}
DEFAULT_COMPILE_ROUNDS = 1
EVAL_CALLS = 4  # evaluations per process after training: the first (ort_trainer: its graph's first use) and 3 timed,
EVAL_SECONDS = 1.0  # or more, cycling the batches, until the timed ones add up to this (the MLP's ~4 ms calls: ~250)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _mlp(features: int, classes: int = 10, hidden: int = 1024):
    """``mlp-1024``'s model: ``(x, labels) -> (cross-entropy, logits)``, two hidden layers of ``hidden``."""
    import torch

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                              torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                              torch.nn.Linear(hidden, classes))

        def forward(self, x, labels):
            logits = self.layers(x)
            return torch.nn.functional.cross_entropy(logits, labels), logits

    return Mlp()


def eager_loss(name: str, model, inputs):
    """The loss of ``model`` on one batch of row ``name``, called as a PyTorch user would."""
    if name.startswith("mlp"):
        return model(*inputs)[0]
    return model(input_ids=inputs[0], attention_mask=inputs[1], labels=inputs[2]).loss


def workload(name: str, batch: int | None = None, seq: int | None = None):
    """``(model, description, batch_of)`` of a row: weights from seed 0, each ``batch_of()`` the next batch
    from seed 1. ``batch`` and ``seq`` replace the row's (``bert*`` names a BERT MLM, ``gpt2*`` a GPT-2)."""
    import torch

    torch.manual_seed(0)
    batch, seq = batch or SIZES[name][0], seq or SIZES[name][1]
    generator = torch.Generator().manual_seed(1)
    if name.startswith("mlp"):
        desc = {"inputs": [("x", ["batch", seq]), ("labels", ["batch"])],
                "outputs": [("loss", [], True), ("logits", ["batch", 10])]}
        return _mlp(seq), desc, lambda: (torch.randn(batch, seq, generator=generator),
                                         torch.randint(0, 10, (batch,), generator=generator))
    import transformers

    if name.startswith("gpt2"):
        config = transformers.GPT2Config(n_positions=max(seq, 128), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         use_cache=False, **_CONFIGS.get(name, {}))
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                         **_CONFIGS.get(name, {}))
        model = transformers.BertForMaskedLM(config)

    def batch_of():
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
        if name.startswith("bert"):
            labels = torch.where(torch.rand(batch, seq, generator=generator) < 0.15, ids, torch.full_like(ids, -100))
        else:
            labels = ids
        return ids, torch.ones_like(ids), labels

    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", config.vocab_size])]}
    return model, desc, batch_of


def _best_seconds(run, repeats: int = 5, least_seconds: float = 0.0) -> float:
    """The fastest of ``repeats`` calls of ``run`` after a warm-up, or of more until they add up to ``least_seconds``."""
    run()  # warm-up: thread pools, packed weights
    best, spent, count = float("inf"), 0.0, 0
    while count < repeats or spent < least_seconds:
        started = time.perf_counter()
        run()
        seconds = time.perf_counter() - started
        best, spent, count = min(best, seconds), spent + seconds, count + 1
    return best


def host_gflops(name: str, model) -> float:
    """torch's best float32 product rate (GFLOP/s) at the row's largest layer shape, now: the host's speed in
    this minute (it drifts with a neighbour's load, and a step made of matrix products drifts with it)."""
    import torch

    m, k, n = max(gemm_shapes(name, model), key=lambda shape: shape[0] * shape[1] * shape[2])
    a, b = torch.randn(m, k), torch.randn(k, n)
    # a quarter second of calls: the MLP's 1.5 ms product, best of 5, read 88-177 GFLOP/s across one bench's processes
    return 2 * m * k * n / _best_seconds(lambda: torch.mm(a, b), least_seconds=0.25) / 1e9


def gemm_shapes(name: str, model) -> list[tuple[int, int, int]]:
    """``(M, K, N)`` of the row's weight products, from its model: the MLP's layers at its batch; a
    transformer's tokens × width × 4·width and back."""
    batch, size = SIZES[name][:2]
    if name.startswith("mlp"):
        import torch

        return sorted({(batch, m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    width = model.config.hidden_size
    return [(batch * size, width, 4 * width), (batch * size, 4 * width, width)]


def ceiling(name: str) -> dict:
    """The row's matrix-product FLOPs per training step, and the machine's best float32 GEMM rate."""
    import onnx
    import onnxruntime
    import torch
    from onnx import TensorProto, helper
    from torch.utils.flop_counter import FlopCounterMode

    model, _, batch_of = workload(name)
    counter = FlopCounterMode(display=False)
    with counter:
        eager_loss(name, model, batch_of()).backward()
    flops = counter.get_total_flops()
    shapes = gemm_shapes(name, model)
    del model
    rates = {"torch": 0.0, "onnxruntime": 0.0}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        rates["torch"] = max(rates["torch"], 2 * m * k * n / _best_seconds(lambda: torch.mm(a, b)) / 1e9)
        graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm",
                                  [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
                                  [helper.make_tensor_value_info("c", TensorProto.FLOAT, [m, n])],
                                  [onnx.numpy_helper.from_array(b.numpy(), "b")])
        model_proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
        session = onnxruntime.InferenceSession(model_proto.SerializeToString(),
                                               providers=["CPUExecutionProvider"])
        feeds = {"a": a.numpy()}
        seconds = _best_seconds(lambda: session.run(None, feeds))
        rates["onnxruntime"] = max(rates["onnxruntime"], 2 * m * k * n / seconds / 1e9)
    return {"flops": flops, "gemm_gflops": rates, "shapes": shapes}


def worker(args) -> dict:
    """One implementation in this process: the first step, ``args.steps`` timed steps, peak RSS
    (``--impl ceiling``: ``ceiling``)."""
    import torch

    if args.impl == "ceiling":
        return ceiling(args.model)
    model, desc, batch_of = workload(args.model)
    # at most 11 distinct batches, taken in turn (the MLP's 200 steps would otherwise hold 105 MB of them)
    distinct = [batch_of() for _ in range(min(args.steps, 10) + 1)]
    batches = [distinct[0]] + [distinct[1 + i % (len(distinct) - 1)] for i in range(args.steps)]
    forward = torch.compile(model) if args.impl == "compile" else model  # inductor, torch's default backend
    if args.impl == "ort":
        from ort_trainer import ORTTrainer
        from ort_trainer.optim import AdamConfig

        trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-4), options=json.loads(args.ort_options or "{}"))
        trainer._train_step_info.fetches = ["loss"]
        build_first, graph_s = trainer._shapes.build_first, []

        def timed_build_first(*args, **kwargs):  # the graph alone: built, or loaded from the cache
            started = time.perf_counter()
            try:
                return build_first(*args, **kwargs)
            finally:
                graph_s.append(time.perf_counter() - started)

        trainer._shapes.build_first = timed_build_first

        def step(inputs):
            return float(trainer.train_step(*inputs))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(inputs):
            optimizer.zero_grad(set_to_none=True)
            loss = eager_loss(args.model, forward, inputs)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            return float(loss)

    gflops = host_gflops(args.model, model)  # before the first step: its tensors are gone before any peak
    started = time.perf_counter()
    losses = [step(batches[0])]
    first = time.perf_counter() - started
    seconds = []
    for inputs in batches[1:]:
        started = time.perf_counter()
        losses.append(step(inputs))
        seconds.append(time.perf_counter() - started)
    report = {"first_s": first, "step_s": seconds, "losses": losses, "peak_mb": _peak_mb(), "host_gflops": gflops}
    if args.impl == "compile":  # training only: its eval mode would compile again
        return report
    if args.impl == "ort":
        report["graph_s"] = graph_s[0]
        evaluate = trainer.eval_step  # with the training loop's fetches: the loss
    else:
        model.eval()

        def evaluate(*inputs):
            with torch.no_grad():
                return eager_loss(args.model, model, inputs)
    report["eval_s"] = _timed_calls(evaluate, batches[:EVAL_CALLS])
    if args.impl == "ort":  # then every output, as eager's forward gives (a graph signature of its own)
        trainer._train_step_info.fetches = []
        report["eval_all_s"] = _timed_calls(evaluate, batches[:EVAL_CALLS])
    report["eval_peak_mb"] = _peak_mb()  # after the evaluations, before any save
    if args.impl == "ort" and args.save:
        with tempfile.TemporaryDirectory() as directory:
            # an empty cache: the save exports the symbolic eval graph, as the model's first save ever does
            os.environ["ORT_TRAINER_CACHE_DIR"] = str(Path(directory) / "cache")
            started = time.perf_counter()
            trainer.save_as_onnx(Path(directory) / "model.onnx")
            report.update(save_s=time.perf_counter() - started, save_peak_mb=_peak_mb())
    return report


def _timed_calls(call, batches: list, least_seconds: float = EVAL_SECONDS, most: int = 500) -> list[float]:
    """Seconds of ``call(*batch)`` for each batch, then for the batches after the first again, in turn,
    until the calls after the first add up to ``least_seconds`` (at most ``most`` calls)."""
    seconds = []
    while len(seconds) < most and (len(seconds) < len(batches) or sum(seconds[1:]) < least_seconds):
        count = len(seconds)
        inputs = batches[count if count < len(batches) else 1 + (count - 1) % (len(batches) - 1)]
        started = time.perf_counter()
        call(*inputs)
        seconds.append(time.perf_counter() - started)
    return seconds


def resize(models: list[str], batch: int = 0, seq: int = 0) -> None:
    """Replace the batch and the sequence length (the MLP's input features) of the ``models``' rows in
    ``SIZES`` (0: keep the row's)."""
    for model in models:
        row_batch, row_seq, steps = SIZES[model]
        SIZES[model] = (batch or row_batch, seq or row_seq, steps)


SETTINGS = {"ort_options": ""}  # --ort-options: the ORTTrainer options of every ort_trainer process, as JSON


def _spawn(model: str, impl: str, steps: int, cache: str, save: bool = False) -> dict:
    batch, seq = SIZES[model][:2]
    command = [sys.executable, __file__, "--worker", "--model", model, "--impl", impl, "--steps", str(steps),
               "--batch", str(batch), "--seq", str(seq), "--ort-options", SETTINGS["ort_options"]]
    if save:
        command.append("--save")
    env = {**os.environ, "ORT_TRAINER_CACHE_DIR": cache}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{model} {impl} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model: str, rounds: int, steps: int, cold_rounds: int = 1, compile_rounds: int = 0) -> dict:
    """Rounds of fresh ort_trainer, eager and (in the first ``compile_rounds``) torch.compile processes for
    one row, their order turning from round to round; the first ``cold_rounds`` ort_trainer processes
    start from an empty graph cache, the later ones also time a first save."""
    runs = {"ort": [], "eager": [], "compile": []}
    with tempfile.TemporaryDirectory() as cache:
        runs["ceiling"] = _spawn(model, "ceiling", 0, cache)
        for number in range(rounds):
            impls = ["ort", "eager"] + (["compile"] if number < compile_rounds else [])
            turn = number % len(impls)
            for impl in impls[turn:] + impls[:turn]:
                cold = impl == "ort" and number < cold_rounds
                if cold:
                    shutil.rmtree(cache)
                    os.mkdir(cache)
                runs[impl].append(_spawn(model, impl, steps, cache, save=impl == "ort" and not cold))
                steps_s = runs[impl][-1]["step_s"]
                print(f"{model} round {number + 1} {impl}: first step {runs[impl][-1]['first_s']:.1f} s, steps "
                      f"{[round(s, 3) for s in steps_s[:5]]}{'...' if len(steps_s) > 5 else ''} (median "
                      f"{statistics.median(steps_s):.3g} s)", file=sys.stderr, flush=True)
    return runs


def row(model: str, runs: dict, cold_rounds: int = 1) -> dict:
    """The table's figures for one row: the first ``cold_rounds`` ort_trainer runs built the graphs."""
    cold, ort, eager = runs["ort"][:cold_rounds], runs["ort"][cold_rounds:], runs["eager"]
    # the first LOSS_STEPS losses: further on, Adam's m / sqrt(v) turns float32 rounding in gradient elements near
    # zero into updates of either sign, and the two runs drift apart (the MLP's 200th loss: 1e-3)
    loss_error = max(abs(a - b) / abs(b) for run in cold + ort
                     for a, b in zip(run["losses"][:LOSS_STEPS], eager[0]["losses"][:LOSS_STEPS]))
    ort_step = statistics.median(s for run in cold + ort for s in run["step_s"])
    eager_step = statistics.median(s for run in eager for s in run["step_s"])
    # round i's two processes ran back to back: their ratio is the speed-up in that minute
    round_speedups = [statistics.median(e["step_s"]) / statistics.median(o["step_s"]) for o, e in zip(cold + ort, eager)]

    def median(runs: list[dict], key, first: bool = False) -> float | None:
        values = [run[key][0] if first else run[key] for run in runs if key in run]
        return statistics.median(values) if values else None

    compiled = runs.get("compile") or []
    return {
        "compile_first_s": median(compiled, "first_s"), "compile_first_range": [run["first_s"] for run in compiled],
        "compile_step_s": statistics.median(s for run in compiled for s in run["step_s"]) if compiled else None,
        "compile_peak_mb": max((r["peak_mb"] for r in compiled), default=None),
        "model": model, "size": "{}×{}".format(*SIZES[model][:2]), "loss_rel_diff": loss_error,
        "cold_s": median(cold, "first_s"), "cold_range": [run["first_s"] for run in cold],
        "warm_s": median(ort, "first_s"), "warm_graph_s": median(ort, "graph_s"),
        "ort_step_s": ort_step, "eager_step_s": eager_step, "speedup": eager_step / ort_step,
        "round_speedups": round_speedups,
        "host_gflops": [run["host_gflops"] for run in cold + ort + eager + compiled if "host_gflops" in run],
        # the processes that built the graphs also imported torch's export stack (~130 MB that a process
        # loading them from the cache does without), so their peak is reported apart
        "ort_peak_cold_mb": max(r["peak_mb"] for r in cold),
        "ort_peak_warm_mb": max(r["peak_mb"] for r in ort) if ort else None,
        "eager_peak_mb": max(r["peak_mb"] for r in eager),
        "save_s": median(ort, "save_s"), "save_range": [run["save_s"] for run in ort],
        # the process's peak before its first save (after training and evaluating) and after it: the save imports
        # torch's export stack (~90 MB of code in a process that found its training graphs in the cache)
        "presave_peak_mb": max((r["eval_peak_mb"] for r in ort if "save_peak_mb" in r), default=None),
        "save_peak_mb": max((r["save_peak_mb"] for r in ort if "save_peak_mb" in r), default=None),
        "gflop": runs["ceiling"]["flops"] / 1e9, "gemm_gflops": max(runs["ceiling"]["gemm_gflops"].values()),
        # the first evaluation after a cold build and after a warm one, with the loop's fetches (the loss); then
        # with every output: the first call after a cold build, and the later calls' median
        "first_eval_cold_s": median(cold, "eval_s", first=True),
        "first_eval_warm_s": median(ort, "eval_s", first=True),
        "first_eval_all_cold_s": median(cold, "eval_all_s", first=True),
        "ort_eval_s": statistics.median(s for run in cold + ort for s in run["eval_all_s"][1:]),
        "eager_eval_s": statistics.median(s for run in eager for s in run["eval_s"][1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model", default="gpt2", choices=sorted(SIZES))
    parser.add_argument("--impl", choices=["ort", "eager", "compile", "ceiling"], default="ort")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--models", default="gpt2,bert,gpt2-656m,mlp-1024")
    parser.add_argument("--rounds", type=int, default=0,
                        help=f"fresh processes per implementation and model (0: the row's, {ROUNDS}, "
                             f"else {DEFAULT_ROUNDS})")
    parser.add_argument("--compile-rounds", type=int, default=-1,
                        help=f"torch.compile processes per model, in the first rounds (-1: the row's, "
                             f"{COMPILE_ROUNDS}, else {DEFAULT_COMPILE_ROUNDS}; 0: none)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per process (0: the row's default)")
    parser.add_argument("--batch", type=int, default=0, help="batch size of every row (0: the row's)")
    parser.add_argument("--seq", type=int, default=0,
                        help="sequence length of every row, the MLP's input features (0: the row's)")
    parser.add_argument("--ort-options", default="",
                        help='ORTTrainer options of the ort_trainer processes, as JSON (e.g. '
                             '\'{"graph_optimizations": {"loss_pieces": false}}\')')
    parser.add_argument("--out", type=Path, default=None,
                        help="the page to write (default: docs/benchmarks_real/<CPU kind>.md, listed in "
                             "docs/benchmarks_real.md)")
    args = parser.parse_args()
    problems = [f"--{name} must be positive (0: the row's), got {value}"
                for name, value in (("batch", args.batch), ("seq", args.seq)) if value < 0]
    models = args.models.split(",")
    unknown = [model for model in models if model not in SIZES]
    if unknown:
        problems.append(f"--models: unknown {unknown}; the rows are {sorted(SIZES)}")
    if problems:
        parser.error("; ".join(problems))
    resize([args.model] if args.worker else models, args.batch, args.seq)
    SETTINGS["ort_options"] = args.ort_options
    if args.worker:
        args.steps = args.steps or SIZES[args.model][2]
        print(json.dumps(worker(args)))
        return
    rows, rounds, compile_rounds = [], {}, {}
    for model in models:
        rounds[model] = args.rounds or ROUNDS.get(model, DEFAULT_ROUNDS)
        compile_rounds[model] = min(rounds[model], args.compile_rounds if args.compile_rounds >= 0
                                    else COMPILE_ROUNDS.get(model, DEFAULT_COMPILE_ROUNDS))
        cold = max(1, min(COLD_ROUNDS.get(model, 1), rounds[model] - 1))  # at least one warm round where there are 2
        rows.append(row(model, measure(model, rounds[model], args.steps or SIZES[model][2], cold,
                                       compile_rounds[model]), cold))
    command = f"python benchmarks/real_sizes.py --models {args.models}"
    command += f" --rounds {args.rounds}" if args.rounds else ""
    command += f" --compile-rounds {args.compile_rounds}" if args.compile_rounds >= 0 else ""
    command += "".join(f" --{name} {value}" for name, value in (("batch", args.batch), ("seq", args.seq)) if value)
    command += f" --ort-options '{args.ort_options}'" if args.ort_options else ""
    cpu = host.describe()
    text = page(command, rounds, compile_rounds, cpu, rows, EVAL_CALLS, EVAL_SECONDS)
    out = args.out or ROOT / "docs" / "benchmarks_real" / f"{cpu['kind']}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if args.out is None:  # the index of the results per CPU kind
        write_index(ROOT / "docs" / "benchmarks_real.md", out.parent)
    print(table(rows))


if __name__ == "__main__":
    main()
