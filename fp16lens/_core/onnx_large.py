"""ONNX graphs over protobuf's 2 GB limit (a Stable Diffusion UNet, SAM's ViT-H encoder,
most language models in FP32): one proto cannot be serialized past 2 GB, so ONNX Runtime,
shape inference, the checker and ``onnx.save`` each need the large tensors in a file
beside the graph. Every stage goes through these four (``session``, ``infer_shapes``,
``check``, ``save``); below the limit each is the plain call.

The user's proto is only read: the calls work on a ``light`` copy that holds the large
tensors' names, types and shapes, their values written to a file where needed."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TWO_GB = 2**31 - 1
"""Protobuf's limit on one serialized message."""
LARGE_TENSOR = 1024
"""Tensors of at least this many bytes go to the data file when a graph is over the limit."""
LIGHT_INFERENCE = 1 << 28
"""Weights (in tensors of ``LARGE_TENSOR`` bytes or more) from which shape inference runs
on the ``light`` copy."""


def is_large(proto) -> bool:
    """Whether ``proto`` cannot be serialized as one message (counted without serializing
    it: upb's ``ByteSize`` does, a copy of the whole model)."""
    weights = _weight_bytes(proto)
    if weights < TWO_GB // 2:
        return False
    return weights + light(proto).ByteSize() > TWO_GB


def tensors(graph) -> Iterator[Any]:
    """Every TensorProto of ``graph``: initializers, Constant and other tensor attributes,
    and those of control-flow bodies."""
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.type == a.TENSOR:
                yield a.t
            elif a.type == a.TENSORS:
                yield from a.tensors
            elif a.type == a.GRAPH:
                yield from tensors(a.g)
            elif a.type == a.GRAPHS:
                for g in a.graphs:
                    yield from tensors(g)


def _copy_fields(dst, src, skip: tuple[str, ...] = ()) -> None:
    """``dst.CopyFrom(src)`` but for the fields ``skip`` names, which are not even read (a
    read of ``raw_data`` copies its bytes)."""
    for fd in src.DESCRIPTOR.fields:
        if fd.name in skip:
            continue
        if _repeated(fd):
            if len(getattr(src, fd.name)):
                getattr(dst, fd.name).extend(getattr(src, fd.name))
        elif src.HasField(fd.name):
            if fd.message_type is not None:
                getattr(dst, fd.name).CopyFrom(getattr(src, fd.name))
            else:
                setattr(dst, fd.name, getattr(src, fd.name))


def _repeated(fd) -> bool:
    """A repeated field (``is_repeated`` in protobuf 6, ``label`` before)."""
    flag = getattr(fd, "is_repeated", None)
    return bool(flag) if flag is not None else fd.label == fd.LABEL_REPEATED


def _light(proto, write: Callable[[bytes], tuple[str, int, int]] | None):
    """A copy of ``proto`` whose large tensors hold no values: each is ONNX external data
    at the (location, offset, length) ``write`` gives for its bytes (``write`` None: they are left
    out, their names, types and shapes kept). ``proto`` is only read: a value assigned into
    a message stays in its protobuf arena until the message is freed, so a proto whose
    tensors were taken out and put back would hold them twice."""

    def emptied(t):
        if not _large_tensor(t):
            return None
        c = type(t)()
        _copy_fields(c, t, skip=("raw_data",))
        _external(c, write and write(t.raw_data))
        return c

    copy = replacing(proto, emptied)
    for c in tensors(copy.graph):  # Constant nodes and bodies: copied whole, emptied here
        if _large_tensor(c):
            where = write and write(c.raw_data)
            c.ClearField("raw_data")
            _external(c, where)
    return copy


def _external(t, where: tuple[str, int, int] | None) -> None:
    t.data_location = t.EXTERNAL
    location, offset, length = where or ("fp16lens-values-left-out", 0, 0)
    entries = [("location", location), ("offset", str(offset))]
    if where is not None:
        entries.append(("length", str(length)))
    for key, value in entries:
        entry = t.external_data.add()
        entry.key, entry.value = key, value


def replacing(proto, replace: Callable[[Any], Any]):
    """A copy of ``proto`` whose initializers are ``replace(t)`` where that is not None
    (a new TensorProto), the others copied. The replaced ones are never copied in first:
    a value assigned over it would stay in the copy's arena, the weights twice."""
    copy = type(proto)()
    _copy_fields(copy, proto, skip=("graph",))
    _copy_fields(copy.graph, proto.graph, skip=("initializer",))
    for t in proto.graph.initializer:
        new = replace(t)
        copy.graph.initializer.add().CopyFrom(t if new is None else new)
    return copy


def light(proto):
    """A copy of ``proto`` whose large tensors keep their names, types and shapes but no
    values: what shape inference and the graph's structure need."""
    return _light(proto, None)


def save(onnx, proto, path: str | Path) -> None:
    """``onnx.save``; a graph over the limit keeps its large tensors in ``<name>.data``
    beside the file (ONNX external data, as exporters write it)."""
    path = Path(path)
    if not is_large(proto):
        onnx.save(proto, str(path))
        return
    data = path.with_name(f"{path.name}.data")
    with open(data, "wb") as f:

        def write(raw: bytes) -> tuple[str, int, int]:
            offset = f.tell()
            f.write(raw)
            return data.name, offset, len(raw)

        lite = _light(proto, write)
    onnx.save(lite, str(path))


@contextlib.contextmanager
def as_file(onnx, proto) -> Iterator[Path]:
    """``proto`` written to a temporary file (with its data file when over the limit)."""
    with tempfile.TemporaryDirectory(prefix="fp16lens-onnx-") as tmp:
        path = Path(tmp) / "model.onnx"
        save(onnx, proto, path)
        yield path


def session(ort, proto, options, providers: tuple[str, ...] = ("CPUExecutionProvider",)):
    """``ort.InferenceSession`` of ``proto``; over the limit, from a temporary file that
    lives as long as the session."""
    if not is_large(proto):
        return ort.InferenceSession(proto.SerializeToString(), options, providers=list(providers))
    import onnx

    tmp = tempfile.TemporaryDirectory(prefix="fp16lens-onnx-")
    path = Path(tmp.name) / "model.onnx"
    save(onnx, proto, path)
    sess = ort.InferenceSession(str(path), options, providers=list(providers))
    sess._fp16lens_files = tmp  # removed with the session
    return sess


def infer_shapes(onnx, proto):
    """``onnx.shape_inference.infer_shapes``; for a graph over ``LIGHT_INFERENCE`` bytes of
    weights, on its ``light`` copy (a serialized copy of the whole graph, and the one
    inference returns, would each cost the weights' size again, and cannot pass 2 GB):
    read the result's types and value_info, not its large initializers' values."""
    if _weight_bytes(proto) < LIGHT_INFERENCE:
        return onnx.shape_inference.infer_shapes(proto)
    return onnx.shape_inference.infer_shapes(light(proto))


def _weight_bytes(proto) -> int:
    return sum(_raw_bytes(t) for t in tensors(proto.graph) if _large_tensor(t))


_ITEM_BYTES = {1: 4, 4: 2, 5: 2, 6: 4, 7: 8, 10: 2, 11: 8, 12: 4, 13: 8, 14: 8, 15: 16, 16: 2}
"""Bytes per element of the ONNX element types wider than one byte (the rest: one)."""


def _raw_bytes(t) -> int:
    """The size of a tensor's ``raw_data``, from its shape and type: every read of
    ``raw_data`` copies it, and upb's ``ByteSize`` serializes the message."""
    n = 1
    for d in t.dims:
        n *= d
    return n * _ITEM_BYTES.get(t.data_type, 1)


def _large_tensor(t) -> bool:
    """A tensor holding at least ``LARGE_TENSOR`` bytes in ``raw_data``."""
    return (
        t.data_location != t.EXTERNAL and t.HasField("raw_data") and _raw_bytes(t) >= LARGE_TENSOR
    )


def check(onnx, proto, full_check: bool = False) -> None:
    """``onnx.checker.check_model``; over the limit, of the graph written to a file (the
    checker takes a path there)."""
    if not is_large(proto):
        onnx.checker.check_model(proto, full_check=full_check)
        return
    with as_file(onnx, proto) as path:
        onnx.checker.check_model(str(path), full_check=full_check)
