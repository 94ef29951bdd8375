"""ONNX model files of any size: the one loader, saver and ONNX Runtime session maker every verb uses.

A protobuf message cannot be serialized past 2 GB, so a model's weights live beside it in ONE external-data
file named after it::

    model.onnx         the graph (nodes, shapes, small constants)
    model.onnx.data    every initializer of EXTERNAL_MIN_BYTES or more, big ones aligned to DATA_ALIGNMENT

    from pagedkv import onnx_io
    model = onnx_io.load("model.onnx")            # weights stay on disk until read
    w = onnx_io.to_array(model.graph.initializer[0])   # a read-only memory map for external tensors
    onnx_io.save(model, "out.onnx", inputs=["model.onnx"])  # out.onnx + out.onnx.data, atomically, checked
    session = onnx_io.ort_session(model)          # ONNX Runtime reads the weights from their files

``load`` keeps external tensors unloaded and points them at their files by absolute path, in memory only, so that
the model can be handed around as a plain ``ModelProto`` whatever folder it came from. Nothing outside this module
gives such a model to ONNX Runtime or ``onnx.checker`` (both refuse absolute locations): ``ort_session`` hands
ONNX Runtime the graph with locations relative to the data's folder (ONNX Runtime memory-maps them),
``save`` copies the bytes into the output's own data file (never into an input's) and checks the written model by
path with ``onnx.checker.check_model``, and ``skeleton`` gives the graph without its weights for in-memory checks
and shape inference. Memory stays about one copy of the weights: external data is copied file to file, read
through memory maps, and never materialized in a proto.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from pagedkv.userio import UsageError, atomic_output, check_input_file, check_output_path

DATA_SUFFIX = ".data"  # model.onnx -> model.onnx.data
EXTERNAL_MIN_BYTES = 1024  # initializers this big or bigger go to the data file (onnx's own default threshold)
DATA_ALIGNMENT = 65536  # offsets of tensors >= ALIGN_MIN_BYTES: the mmap granularity ONNX Runtime maps at
ALIGN_MIN_BYTES = 1 << 20
# The most bytes of inline tensor data a model held in memory may carry and still be serialized for ONNX Runtime
# (the protobuf limit is 2 GiB for the whole message).
INLINE_LIMIT_BYTES = 1 << 31
_COPY_CHUNK = 64 << 20


def data_path(path) -> Path:
    """The external-data file that belongs to the model file ``path``: ``path`` + ``.data``."""
    path = Path(path)
    return path.with_name(path.name + DATA_SUFFIX)


# ---- tensors ------------------------------------------------------------------------------------------
def _walk(graph: onnx.GraphProto) -> Iterator[tuple[onnx.TensorProto, bool]]:
    """(tensor, is an initializer) for every tensor of a graph and its subgraphs."""
    for tensor in graph.initializer:
        yield tensor, True
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t, False
            for tensor in attr.tensors:
                yield tensor, False
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _walk(sub)


def _walk_model(model: onnx.ModelProto) -> Iterator[tuple[onnx.TensorProto, bool]]:
    yield from _walk(model.graph)
    for function in model.functions:
        for node in function.node:
            for attr in node.attribute:
                for tensor in ([attr.t] if attr.HasField("t") else []) + list(attr.tensors):
                    yield tensor, False


def tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model: initializers and node attributes, subgraphs and functions included."""
    return (tensor for tensor, _ in _walk_model(model))


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _external_info(tensor: onnx.TensorProto) -> tuple[str, int, int | None]:
    """(location, offset, length or None) of an external tensor."""
    info = {entry.key: entry.value for entry in tensor.external_data}
    if "location" not in info:
        raise ValueError(f"tensor {tensor.name!r}: external data without a location")
    length = info.get("length")
    return info["location"], int(info.get("offset", 0) or 0), int(length) if length else None


def _set_external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes of a tensor's data, wherever it is."""
    if is_external(tensor):
        location, _, length = _external_info(tensor)
        if length is not None:
            return length
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    if tensor.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in tensor.string_data)
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def external_files(model: onnx.ModelProto) -> set[Path]:
    """The data files the model's external tensors live in (absolute; relative locations from the cwd)."""
    return {Path(os.path.abspath(_external_info(t)[0])) for t in tensors(model) if is_external(t)}


def inline_bytes(model: onnx.ModelProto) -> int:
    return sum(tensor_bytes(t) for t in tensors(model) if not is_external(t))


# Dtypes a memory map can show as they are stored (ONNX's little-endian raw layout is numpy's).
_MAPPABLE = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16,
             onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
             onnx.TensorProto.UINT64, onnx.TensorProto.UINT32, onnx.TensorProto.UINT16, onnx.TensorProto.UINT8,
             onnx.TensorProto.BOOL}


def to_array(tensor: onnx.TensorProto) -> np.ndarray:
    """The tensor's value. External data is read through a read-only memory map (no copy until used), so reading
    one weight of a big model costs only that weight's pages."""
    if not is_external(tensor):
        return numpy_helper.to_array(tensor)
    location, offset, length = _external_info(tensor)
    shape = tuple(int(d) for d in tensor.dims)
    if tensor.data_type in _MAPPABLE:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        count = int(np.prod(shape, dtype=np.int64))
        if length is not None and length != count * dtype.itemsize:
            raise ValueError(f"tensor {tensor.name!r}: {length} bytes of external data for shape {list(shape)} "
                             f"of {dtype.name}")
        if count == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(location, dtype=dtype, mode="r", offset=offset, shape=shape)
    with open(location, "rb") as f:  # packed sub-byte / float8 types: numpy_helper unpacks them
        f.seek(offset)
        raw = f.read() if length is None else f.read(length)
    inline = onnx.TensorProto()
    inline.CopyFrom(tensor)
    del inline.external_data[:]
    inline.data_location = onnx.TensorProto.DEFAULT
    inline.raw_data = raw
    return numpy_helper.to_array(inline)


# ---- load ---------------------------------------------------------------------------------------------
def load(path, name: str = "input") -> onnx.ModelProto:
    """The model at ``path``, its external tensors left on disk and pointed at their files by absolute path (in
    memory only; see the module docstring). Bad input (missing, not ONNX, a data file missing or too short) is a
    ``UsageError`` naming ``name``, the file and the tensor."""
    src = check_input_file(path, name)
    try:
        model = onnx.load(str(src), load_external_data=False)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError, RuntimeWarning, UnicodeDecodeError: not ONNX
        raise UsageError(f"{name}: {str(src)!r} is not an ONNX model (it does not parse as one)") from None
    if not model.graph.node or not model.opset_import:
        raise UsageError(f"{name}: {str(src)!r} is not an ONNX model (no graph nodes or opsets in it)")
    folder = src.resolve().parent
    sizes: dict[Path, int] = {}
    for tensor in tensors(model):
        if not is_external(tensor):
            continue
        location, offset, length = _external_info(tensor)
        file = (folder / location).resolve()
        if file not in sizes:
            if not file.is_file():
                raise UsageError(f"{name}: tensor {tensor.name!r} keeps its data in {location!r}, which is missing "
                                 f"beside {str(src)!r} (an ONNX model and its data file travel together)")
            sizes[file] = file.stat().st_size
        end = offset + (length if length is not None else 0)
        if end > sizes[file]:
            raise UsageError(f"{name}: tensor {tensor.name!r} needs bytes {offset}..{end} of {str(file)!r}, which "
                             f"has {sizes[file]} (a truncated or mismatched data file)")
        _set_external(tensor, str(file), offset, length if length is not None else sizes[file] - offset)
    return model


def load_if_path(model, name: str = "input") -> onnx.ModelProto:
    """``model`` itself when it is a ``ModelProto``, else ``load(model)``."""
    return model if isinstance(model, onnx.ModelProto) else load(model, name)


# ---- save ---------------------------------------------------------------------------------------------
def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[:_COPY_CHUNK]):]


def _copy_range(src: Path, offset: int, length: int, fd: int) -> None:
    """Append bytes offset..offset+length of ``src`` to ``fd``, file to file (copy_file_range where it works)."""
    with open(src, "rb", buffering=0) as f:
        done = 0
        while done < length:
            n = min(_COPY_CHUNK, length - done)
            try:
                n = os.copy_file_range(f.fileno(), fd, n, offset + done)
            except (AttributeError, OSError):  # no copy_file_range here (or across these file systems)
                f.seek(offset + done)
                chunk = f.read(n)
                _write_all(fd, chunk)
                n = len(chunk)
            if n <= 0:
                raise OSError(f"{src}: ends before byte {offset + length}")
            done += n


def _write_data(model: onnx.ModelProto, data_file: Path, data_name: str, undo: list) -> None:
    """Move every initializer of EXTERNAL_MIN_BYTES or more and every external tensor (of whatever file) into
    ``data_file`` and point it at ``data_name``; ``undo`` collects what ``_undo`` needs to give the tensors back.
    Node-attribute tensors (Constant nodes) stay inline unless they already were external, as onnx's own
    external-data conversion leaves them: tools read them as part of the graph."""
    fd = os.open(data_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        end = 0
        for tensor, initializer in _walk_model(model):
            if tensor.data_type == onnx.TensorProto.STRING:
                continue
            external, size = is_external(tensor), tensor_bytes(tensor)
            if not external and (size < EXTERNAL_MIN_BYTES or not initializer):
                continue
            offset = end
            if size >= ALIGN_MIN_BYTES and offset % DATA_ALIGNMENT:
                offset += DATA_ALIGNMENT - offset % DATA_ALIGNMENT
            os.lseek(fd, offset, os.SEEK_SET)
            if external:
                location, src_offset, length = _external_info(tensor)
                _copy_range(Path(location), src_offset, length, fd)
                undo.append((tensor, ("external", location, src_offset, length)))
            else:
                raw = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
                length = len(raw)
                _write_all(fd, raw)
                del raw
                saved = onnx.TensorProto()
                saved.CopyFrom(tensor)
                for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    tensor.ClearField(field)
                undo.append((tensor, ("inline", saved)))
            _set_external(tensor, data_name, offset, length)
            end = offset + length
        os.ftruncate(fd, end)
    finally:
        os.close(fd)


def _undo(undo: list) -> None:
    for tensor, (kind, *what) in undo:
        if kind == "external":
            location, offset, length = what
            _set_external(tensor, location, offset, length)
        else:
            tensor.CopyFrom(what[0])


def save(model: onnx.ModelProto, path, *, inputs: Iterable = (), name: str = "output", check: bool = True) -> Path:
    """Write ``model`` to ``path`` and its initializers of EXTERNAL_MIN_BYTES or more to ``path`` + ``.data`` (always
    written, empty when no tensor is that big), both at once
    (``userio.atomic_output``: the two appear together, or, on an error, neither), then check the written model by
    path with ``onnx.checker.check_model``. External data the model refers to (an input's data file) is copied,
    never moved or overwritten: an output whose data file is one the model reads from is refused.

    Afterwards the model's tensors refer to the saved data file (like ``onnx.save_model`` with external data), so
    the model stays usable and holds no second copy of its inline weights."""
    out = Path(path)
    data = data_path(out)
    inputs = [*external_files(model), *(p for p in inputs if p is not None)]
    check_output_path(data, inputs, f"{name} (its data file)")
    undo = []
    try:
        with atomic_output(out, inputs=inputs, name=name, companions=[data.name]) as tmp:
            _write_data(model, tmp.with_name(data.name), data.name, undo)
            with open(tmp, "wb") as f:
                f.write(model.SerializeToString())
            if check:
                onnx.checker.check_model(str(tmp))
    except BaseException:
        _undo(undo)
        raise
    final = str(data.resolve())
    for tensor, _ in undo:
        _, offset, length = _external_info(tensor)
        _set_external(tensor, final, offset, length)
    return out


# ---- the weightless view and ONNX Runtime ----------------------------------------------------------------
def _copy_fields(src, dst, skip: set[str]) -> None:
    """Copy every set field of one protobuf message into another of the same type, but those named in ``skip``
    (shares nothing: repeated and message fields are copied)."""
    for desc, value in src.ListFields():
        if desc.name in skip:
            continue
        if desc.is_repeated:
            getattr(dst, desc.name).extend(value)
        elif desc.message_type is not None:
            getattr(dst, desc.name).CopyFrom(value)
        else:
            setattr(dst, desc.name, value)


def skeleton(model: onnx.ModelProto, min_bytes: int = EXTERNAL_MIN_BYTES) -> onnx.ModelProto:
    """A copy of the model without its weights: every external initializer and every inline one of ``min_bytes``
    or more becomes a graph input of the same type and shape. For what needs the structure only (``onnx.checker``
    and shape inference in memory, which refuse or cannot read absolute external locations); small constants,
    which shape inference may read, stay."""
    out = onnx.ModelProto()
    _copy_fields(model, out, {"graph"})
    _copy_fields(model.graph, out.graph, {"initializer"})
    for tensor, _ in _walk(out.graph):  # a Constant node's external value: inline (shape inference reads it)
        if is_external(tensor):
            tensor.CopyFrom(numpy_helper.from_array(to_array(tensor), tensor.name))
    listed = {i.name for i in model.graph.input}
    for tensor in model.graph.initializer:
        if is_external(tensor) or tensor_bytes(tensor) >= min_bytes:
            if tensor.name not in listed:
                out.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type,
                                                                          list(tensor.dims)))
        else:
            out.graph.initializer.append(tensor)
    return out


def ort_session(model, options=None, providers=("CPUExecutionProvider",)):
    """An ONNX Runtime session over a model file (ONNX Runtime opens it and its data) or a ``ModelProto`` (its
    external tensors are handed over relative to their common folder, which ONNX Runtime memory-maps; inline data
    past the protobuf limit cannot be handed over and is refused with what to do instead)."""
    import onnxruntime as ort

    options = options or ort.SessionOptions()
    if not isinstance(model, onnx.ModelProto):
        return ort.InferenceSession(str(model), options, providers=list(providers))
    files = external_files(model)
    if inline_bytes(model) >= INLINE_LIMIT_BYTES:
        raise ValueError(f"model: {inline_bytes(model) / 2**30:.1f} GiB of weights held in memory, past the 2 GiB "
                         "protobuf limit; save it with pagedkv.onnx_io.save and open the saved file")
    if not files:
        return ort.InferenceSession(model.SerializeToString(), options, providers=list(providers))
    folder = Path(os.path.commonpath([str(f.parent) for f in files]))
    handed = onnx.ModelProto()
    handed.CopyFrom(model)
    for tensor in tensors(handed):
        if is_external(tensor):
            location, offset, length = _external_info(tensor)
            _set_external(tensor, os.path.relpath(os.path.abspath(location), folder), offset, length)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(handed.SerializeToString(), options, providers=list(providers))
