"""The communicators on their own, under ``mpiexec -n 2``: every collective on known values.

``python collectives_job.py --out DIR --backend mpi|gloo|nccl [--device auto|cpu|cuda:N]`` writes
``DIR/collectives_rank<r>.json`` with what each collective left in the buffers and the errors the
refusals raised. The buffers are on the device ``setup_onnxruntime_with_mpi`` gave the rank with
``--device auto`` (NCCL's default: a GPU where there is one), on the CPU with ``--device cpu`` (the
default of the others), or on the device named (``--device cuda:0``: gloo with every rank on one GPU).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from ort_trainer.distributed import make_communicator, setup_onnxruntime_with_mpi  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--backend", choices=["mpi", "gloo", "nccl"], required=True)
parser.add_argument("--device", default=None,
                    help="where the buffers are: 'auto' (the device setup_onnxruntime_with_mpi picked), 'cpu' or a "
                         "device id such as 'cuda:0' (default: 'auto' for nccl, 'cpu' otherwise)")
args = parser.parse_args()

ctx = setup_onnxruntime_with_mpi()
rank = ctx.world_rank
device = args.device or ("auto" if args.backend == "nccl" else "cpu")
device = ctx.device if device == "auto" else device
torch.set_default_device(device)
comm = make_communicator(args.backend, device, ctx.world_size, rank)
report = {"class": type(comm).__name__, "backend": comm.backend, "device": device, "launcher": ctx.launcher}

summed = torch.arange(1000, dtype=torch.float32) * (rank + 1)
comm.allreduce_sum(summed, step=0)
report["allreduce_sum"] = summed.tolist()

# a slice of a bigger flat buffer is all-reduced in place, leaving the rest alone
flat = torch.full((10,), float(rank))
comm.allreduce_sum(flat[2:6], step=0)
report["allreduce_slice"] = flat.tolist()

report["broadcast"] = {}
for name, tensor in {"float32": torch.arange(6, dtype=torch.float32) + 10 * rank,
                     "int64": torch.tensor([rank, 7 + rank]), "bool": torch.tensor([rank == 0, rank == 1]),
                     "scalar": torch.tensor(3.5 + rank)}.items():
    comm.broadcast(tensor)
    report["broadcast"][name] = tensor.tolist()
from_last = torch.full((4,), float(rank))
comm.broadcast(from_last, root=ctx.world_size - 1)
report["broadcast_from_last_rank"] = from_last.tolist()

# ZeRO ranges: equal (in place on the flat buffer) and unequal (padded), twice each way round
report["allgather"] = {}
size = ctx.world_size
for counts in ([5] * size, [7 if r % 2 == 0 else 3 for r in range(size)], [3 if r % 2 == 0 else 7 for r in range(size)],
               [7 if r % 2 == 0 else 3 for r in range(size)]):
    buffer = torch.full((sum(counts),), -1.0)
    start = sum(counts[:rank])
    buffer[start:start + counts[rank]] = torch.arange(counts[rank], dtype=torch.float32) + 100 * (rank + 1)
    comm.allgather(buffer, counts, step=1)
    report["allgather"][str(counts)] = buffer.tolist()

report["allgather_object"] = comm.allgather_object({"rank": rank})
comm.barrier()

errors = {}
for name, call in {
    "device": lambda: comm.allreduce_sum(torch.empty(3, device="meta")),
    "strided": lambda: comm.allreduce_sum(torch.zeros(4, 4)[:, 0]),
    "counts": lambda: comm.allgather(torch.zeros(10), [5, 4]),
}.items():
    try:
        call()
        errors[name] = None
    except (RuntimeError, ValueError) as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
report["errors"] = errors
comm.allreduce_sum(torch.ones(2), step=2)  # the refusals left the ranks in step
(args.out / f"collectives_rank{rank}.json").write_text(json.dumps(report))
