"""Writing an ONNX model together with its weights, one weight at a time.

``onnx.save`` needs the whole ``ModelProto`` in memory with every weight inside it, and then a
serialized copy of it: for GPT-2 small that held 2 × 475 MB on top of the trainer's buffers, and a
model over 2 GB cannot be serialized at all (protobuf's limit on one message). ``save_with_weights``
never holds more than one weight:

- inline (a single ``.onnx`` file, the default below ``INLINE_LIMIT``): the model without the
  weights is written first, then each weight as a message of its own that protobuf parsers merge
  into the first, its bytes straight from the weight's memory. Protobuf's encoding defines a message field that appears twice as the merge of
  the two (repeated fields appended), so ``model`` followed by ``ModelProto(graph=GraphProto(
  initializer=[w]))`` for each weight parses as ``model`` with those initializers.
- external data (ONNX's format for models over 2 GB, as ``onnx.external_data_helper`` writes it): the weights'
  bytes go to ``<name>.data`` next to the model, each at an offset aligned to 4096 bytes (ONNX
  Runtime can then map them instead of reading them), and the model refers to them by offset and
  length. ``onnx.load`` and ``onnxruntime.InferenceSession`` load it from the model's path.

Both files go through ``atomic_write``: the data file is moved into place only once the model file
is complete and the model file right after it, so a failed save leaves an earlier save whole.

``save_while_building`` writes an inline file's weights while the graph is still being made (the
weights' messages first, the graph's after them: the merge does not depend on the order): GPT-2
small's first ``save_as_onnx`` in a process spends ~3 s exporting its graph and ~1 s writing 500 MB.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Callable, Collection, Iterable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._interrupt import stop_if_interrupted
from ._temporaries import atomic_write

#: the largest model written as one file: protobuf refuses messages of 2 GiB; the margin leaves room
#: for the graph itself
INLINE_LIMIT = 2**31 - 2**26
_ALIGNMENT = 4096

#: ``name -> array`` of a weight, asked for when it is written (the array may be a view: it is read
#: before the next weight is asked for)
WeightReader = Callable[[str], np.ndarray]


def data_path(path: str | os.PathLike) -> Path:
    """Where ``save_with_weights`` puts the external data of the model at ``path``."""
    path = Path(path)
    return path.with_name(path.name + ".data")


def save_with_weights(model: onnx.ModelProto, path: str | os.PathLike, weights: Mapping[str, tuple],
                      read: WeightReader, external_data: bool | None = None) -> bool:
    """Write ``model`` to ``path`` with the weights ``weights`` as initializers.

    Args:
        model: the graph, reading each weight of ``weights`` by name but holding none of them.
        weights: ``{name: (shape, numpy dtype)}`` in the order they are written.
        read: returns a weight's current value; called once per weight, one at a time.
        external_data: True writes the weights to ``data_path(path)``, False into the model file;
            None (the default) does the first only when the model would pass ``INLINE_LIMIT``.

    Returns:
        Whether the weights went to an external data file.

    Raises:
        ValueError: ``external_data`` is False and the model is over protobuf's 2 GiB limit.
    """
    sizes = _sizes(weights)
    total = sum(sizes.values()) + model.ByteSize()
    if external_data is None:
        external_data = total > INLINE_LIMIT
    elif not external_data and total > INLINE_LIMIT:
        raise ValueError(f"the model is {total / 2**30:.2f} GiB, over protobuf's 2 GiB limit for one file: save it "
                         "with external_data=True (or None) instead")
    if external_data:
        _save_external(model, Path(path), weights, sizes, read)
    else:
        atomic_write(path, lambda temporary: _write_inline(model, temporary, weights, read), what="save_as_onnx")
    return external_data


def save_while_building(build: Callable[[], tuple[onnx.ModelProto, list[str]]], path: str | os.PathLike,
                        weights: Mapping[str, tuple], read: WeightReader, external_data: bool | None = None,
                        early: Collection[str] | None = None) -> bool:
    """``save_with_weights`` of the model ``build()`` makes, its weights written while it is made.

    Inline (``external_data`` not True and ``weights`` under ``INLINE_LIMIT``), a thread writes the
    weights of ``early`` to the file while ``build`` runs here; then the other weights the model
    reads and the model follow them. Where the model does not read every weight of ``early``, or
    passes ``INLINE_LIMIT`` with its graph, that file is dropped and the model written by
    ``save_with_weights``, as it is with external data.

    Args:
        build: returns the model, holding no weight, and the names of ``weights`` it reads.
        path, weights, read, external_data: as ``save_with_weights`` (``read`` is called from the
            writing thread for ``early``, once per weight, one at a time).
        early: the weights the model surely reads (the trained ones: a BatchNorm's counter is a
            weight that only training reads); None: all of ``weights``.

    Returns:
        Whether the weights went to an external data file.

    Raises:
        ValueError: ``external_data`` is False and the weights are over protobuf's 2 GiB limit
            (before anything is built or written).
    """
    total = sum(_sizes(weights).values())
    if external_data is False and total > INLINE_LIMIT:
        raise ValueError(f"the weights are {total / 2**30:.2f} GiB, over protobuf's 2 GiB limit for one file: save "
                         "with external_data=True (or None) instead")
    built: list = []
    chosen = set(weights if early is None else early)
    early = [name for name in weights if name in chosen]
    if not external_data and total <= INLINE_LIMIT:
        def write(temporary: str) -> None:
            with open(temporary, "wb") as out:
                writer = _WeightWriter(out, early, read)
                writer.start()
                try:
                    built.extend(build())
                    stop_if_interrupted()  # Ctrl-C during the build: stop before the rest is written
                except BaseException:
                    writer.stop_asked.set()
                    raise
                finally:
                    writer.join()
                writer.raise_error()
                model, names = built
                if not chosen <= set(names) or total + model.ByteSize() > INLINE_LIMIT:
                    raise _Rewrite
                _write_weights(out, [name for name in names if name not in chosen], read)
                out.write(model.SerializeToString())
        try:
            atomic_write(path, write, what="save_as_onnx")
            return False
        except _Rewrite:
            pass
    model, names = built or build()
    return save_with_weights(model, path, {name: weights[name] for name in names}, read, external_data)


class _Rewrite(Exception):
    """The file written alongside the build does not suit the model built: written again."""


class _WeightWriter(threading.Thread):
    """Writes each weight as ``_write_initializer`` does, in a thread of its own, until done or told to stop."""

    def __init__(self, out, weights: Iterable[str], read: WeightReader):
        super().__init__(name="ort_trainer-save-weights", daemon=True)
        self._out, self._names, self._read = out, list(weights), read
        self.stop_asked = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            _write_weights(self._out, self._names, self._read, self.stop_asked)
        except BaseException as error:  # noqa: BLE001  (raised in the caller's thread by ``raise_error``)
            self._error = error

    def raise_error(self) -> None:
        """Raise what stopped the thread, if anything did (call after ``join``)."""
        if self._error is not None:
            raise self._error


def _sizes(weights: Mapping[str, tuple]) -> dict[str, int]:
    """Bytes of each weight of ``{name: (shape, dtype)}``."""
    return {name: int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            for name, (shape, dtype) in weights.items()}


def _write_inline(model: onnx.ModelProto, temporary: str, names: Iterable[str], read: WeightReader) -> None:
    with open(temporary, "wb") as out:
        out.write(model.SerializeToString())
        _write_weights(out, names, read)


def _write_weights(out, names: Iterable[str], read: WeightReader, stop: threading.Event | None = None) -> None:
    """``_write_initializer`` for each weight of ``names``, read one at a time, until ``stop`` is set."""
    for name in names:
        if stop is not None and stop.is_set():
            return
        if threading.current_thread() is threading.main_thread():
            stop_if_interrupted()  # Ctrl-C: stop here, and no file is written
        _write_initializer(out, name, np.ascontiguousarray(read(name)))


def _field_tag(message: type, field: str) -> bytes:
    """The key of a length-delimited field (protobuf encoding: field number << 3 | wire type 2)."""
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint: 7 bits per byte, least significant first, high bit = more follow."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_GRAPH, _INITIALIZER = _field_tag(onnx.ModelProto, "graph"), _field_tag(onnx.GraphProto, "initializer")
_RAW_DATA = _field_tag(onnx.TensorProto, "raw_data")


def _write_initializer(out, name: str, value: np.ndarray) -> None:
    """Append ``ModelProto(graph=GraphProto(initializer=[tensor]))`` for ``value`` to ``out``,
    its bytes written straight from the array's memory (``numpy_helper.from_array`` and
    ``SerializeToString`` would copy a 154 MB embedding twice over)."""
    if sys.byteorder != "little":  # raw_data is little-endian: from_array swaps the bytes
        tensor = numpy_helper.from_array(value, name)
        out.write(onnx.ModelProto(graph=onnx.GraphProto(initializer=[tensor])).SerializeToString())
        return
    header = onnx.TensorProto(name=name, dims=value.shape, data_type=helper.np_dtype_to_tensor_dtype(value.dtype))
    tensor_head = header.SerializeToString() + _RAW_DATA + _varint(value.nbytes)
    tensor_size = len(tensor_head) + value.nbytes
    graph_head = _INITIALIZER + _varint(tensor_size)
    out.write(_GRAPH + _varint(len(graph_head) + tensor_size) + graph_head + tensor_head)
    out.write(value.data)


def _save_external(model: onnx.ModelProto, path: Path, weights: Mapping[str, tuple], sizes: dict[str, int],
                   read: WeightReader) -> None:
    data = data_path(path)
    located = onnx.ModelProto()
    located.CopyFrom(model)
    offsets, end = {}, 0
    for name, (shape, dtype) in weights.items():
        offsets[name] = end = -(-end // _ALIGNMENT) * _ALIGNMENT
        tensor = located.graph.initializer.add()
        tensor.name, tensor.data_type = name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        tensor.dims.extend(shape)
        tensor.data_location = onnx.TensorProto.EXTERNAL  # ONNX's external data fields (onnx.proto)
        for key, value in (("location", data.name), ("offset", end), ("length", sizes[name])):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        end += sizes[name]

    def write_data(temporary: str) -> None:
        with open(temporary, "wb") as out:
            for name in weights:
                stop_if_interrupted()  # Ctrl-C: stop here, and neither file is written
                out.seek(offsets[name])
                value = np.ascontiguousarray(read(name))
                if value.nbytes != sizes[name]:
                    raise ValueError(f"weight {name!r}: {value.nbytes} bytes, expected {sizes[name]}")
                out.write(value.data)
            out.truncate(end)

    def write_model(temporary: str) -> None:
        with open(temporary, "wb") as out:
            out.write(located.SerializeToString())
        atomic_write(data, write_data, what="save_as_onnx")  # the model is complete: now the data, then the model

    # once the data is in place, its model follows it whatever happens (Ctrl-C is raised after)
    atomic_write(path, write_model, what="save_as_onnx", stop_before_move=False)


__all__ = ["INLINE_LIMIT", "data_path", "save_while_building", "save_with_weights"]
