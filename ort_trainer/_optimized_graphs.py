"""ONNX Runtime's optimized form of each graph, kept on disk so that a later process loads it instead
of optimizing the graph again.

Making a session optimizes its graph first (constant folding, the GELU, LayerNorm and Gemm fusions,
layout transforms): 0.37-0.42 s of the 0.40 s that GPT-2 small's training session takes to make on
the 2-core AMD EPYC (Zen 4), against 0.07-0.09 s to load the optimized graph with optimizations off.
The first process that makes a session of a graph asks ONNX Runtime to write the graph it optimized
(``SessionOptions.optimized_model_filepath``); later ones load that file with
``ORT_DISABLE_ALL``. This is ONNX Runtime's documented offline mode, with its caveat: an optimized
graph may hold transforms for the machine it was made on (its CPU's instruction set). The file's name
is therefore a hash of the graph's bytes, ONNX Runtime's version, the execution providers, the
optimization level, the disabled optimizers and this host's CPU (model and feature flags).

Files live under ``<graph cache>/.optimized/`` (``ORT_TRAINER_CACHE_DIR``; a dot name, as the graph
cache's ``.links/``: no graph entry; ``off`` turns this off with the graph cache), are written to a
temporary name and renamed into place, so a reader never sees half a file. A file ONNX Runtime refuses
to load is removed and its key marked ``.refused``: that graph is optimized in each process, as without
this cache. Sessions made with the user's own session options never use it (what else they set is not
known), nor do devices whose optimized graphs are not known to load back
(``Device.reuses_optimized_graphs``: the CPU only).
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import os
import platform
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

from ._logging import logger

_FORMAT = "1"


def host_identity() -> str:
    """The CPU this process runs on, as ONNX Runtime's graph transforms may see it: the model name and
    feature flags of ``/proc/cpuinfo`` (elsewhere: the machine and processor ``platform`` names)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            fields = {}
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
        return " | ".join(fields.get(key, "") for key in ("vendor_id", "model name", "flags", "Features", "CPU part"))
    except OSError:
        return f"{platform.machine()} | {platform.processor()}"


class OptimizedGraphs:
    """Sessions made from ONNX Runtime's optimized graphs on disk, written by the first process."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._host = host_identity()

    def key(self, data: bytes, options: ort.SessionOptions, providers: list, disabled: list[str]) -> str:
        """The file name of one graph's optimized form (hex SHA-256, see the module docstring)."""
        digest = hashlib.sha256(data)
        digest.update(repr([_FORMAT, ort.__version__, providers, str(options.graph_optimization_level),
                            sorted(disabled), self._host]).encode())
        return digest.hexdigest()

    def session(self, data: bytes, options: ort.SessionOptions, providers: list,
                disabled: list[str]) -> ort.InferenceSession:
        """A session of the graph ``data`` (a serialized ``ModelProto``): from its optimized form when
        a process saved one, else optimized here (and saved, when the cache folder can be written)."""
        key = self.key(data, options, providers, disabled)
        path = self.root / f"{key}.onnx"
        refused = self.root / f"{key}.refused"
        if path.is_file():
            try:
                with _level(options, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
                    session = ort.InferenceSession(str(path), options, providers=providers)
                logger.debug("session made from the optimized graph %s", path)
                return session
            except Exception as exc:  # noqa: BLE001 - ONNX Runtime's errors have no common base class
                logger.debug("ONNX Runtime refused its optimized graph %s (%s); optimizing the graph instead",
                             path, str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
                with contextlib.suppress(OSError):
                    path.unlink()
                    refused.touch()
        def optimized() -> ort.InferenceSession:  # the graph optimized here, as without this cache
            return ort.InferenceSession(data, options, providers=providers, disabled_optimizers=disabled)

        if refused.exists() or not self._writable():
            return optimized()
        handle, temporary = tempfile.mkstemp(prefix=f".{key[:12]}-", suffix=".onnx", dir=self.root)
        os.close(handle)
        try:
            try:
                with _saved_to(options, temporary):
                    session = optimized()
            except Exception:  # noqa: BLE001 - saving failed (or the graph itself): without saving, as before
                logger.debug("ONNX Runtime could not save its optimized graph; optimizing without saving")
                return optimized()
            if os.path.getsize(temporary):
                _in_session_order(temporary, data)
                os.replace(temporary, path)
            return session
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)

    def _writable(self) -> bool:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        return os.access(self.root, os.W_OK)


def _in_session_order(path: str, original: bytes) -> None:
    """Rewrite the optimized graph at ``path`` with its nodes in the order the session that wrote it runs them.

    ONNX Runtime writes an optimized graph in a topological order of its own; a session that loads it
    numbers the nodes in that order, and with ``ExecutionOrder.PRIORITY_BASED`` (the engine's: the ready
    node of lowest number first) would run them in it, which held GPT-2 small's activations longer (peak
    RSS 2790 -> 2885 MB). The session that optimized the graph numbered the original nodes in the
    original graph's order and the nodes its optimizers made after all of them. The same numbering is
    rebuilt here (a node keeps its original number when its name is the original's, else it comes after
    the original nodes, in the written order), and the nodes are written in the order
    ``PRIORITY_BASED`` takes them by it: ``Shape`` and ``Size`` first when ready, else the lowest number
    (``PriorityNodeCompare`` in ONNX Runtime's ``graph_viewer.cc``). A graph with subgraphs is left as
    written (their nodes read names of the outer graph the order below does not see).
    """
    model = onnx.load(path, load_external_data=False)
    nodes = list(model.graph.node)
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in nodes for a in n.attribute):
        return
    source = onnx.ModelProto()
    source.ParseFromString(original)
    numbers = {n.name: i for i, n in enumerate(source.graph.node) if n.name}
    count = len(source.graph.node)
    number = [numbers.get(n.name, count + i) if n.name else count + i for i, n in enumerate(nodes)]
    producer = {output: i for i, n in enumerate(nodes) for output in n.output if output}
    readers: list[list[int]] = [[] for _ in nodes]
    waiting = [0] * len(nodes)
    for i, node in enumerate(nodes):
        for parent in {producer[name] for name in node.input if name in producer}:
            readers[parent].append(i)
            waiting[i] += 1
    ready = [(n.op_type not in ("Shape", "Size"), number[i], i) for i, n in enumerate(nodes) if not waiting[i]]
    heapq.heapify(ready)
    order = []
    while ready:
        *_, i = heapq.heappop(ready)
        order.append(i)
        for reader in readers[i]:
            waiting[reader] -= 1
            if not waiting[reader]:
                heapq.heappush(ready, (nodes[reader].op_type not in ("Shape", "Size"), number[reader], reader))
    if len(order) != len(nodes):
        return  # not a graph ONNX Runtime could have run: keep it as written
    del model.graph.node[:]
    model.graph.node.extend(nodes[i] for i in order)
    with open(path, "wb") as out:
        out.write(model.SerializeToString())


@contextlib.contextmanager
def _level(options: ort.SessionOptions, level: ort.GraphOptimizationLevel):
    """``options`` with ``graph_optimization_level`` set to ``level`` for the block."""
    old = options.graph_optimization_level
    options.graph_optimization_level = level
    try:
        yield
    finally:
        options.graph_optimization_level = old


@contextlib.contextmanager
def _saved_to(options: ort.SessionOptions, path: str):
    """``options`` writing the optimized graph to ``path`` for the block."""
    old = options.optimized_model_filepath
    options.optimized_model_filepath = path
    try:
        yield
    finally:
        options.optimized_model_filepath = old


__all__ = ["OptimizedGraphs", "host_identity"]
