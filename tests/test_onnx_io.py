"""pagedkv.onnx_io: one model file + one data file, written atomically and checked by path; weights read through
memory maps; ONNX Runtime sessions from a ModelProto whose weights stay on disk; the weightless skeleton."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pagedkv import onnx_io
from pagedkv.builder.graph_view import GraphView
from pagedkv.userio import UsageError


def _model(seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x [1, 300] -> MatMul(W1 300x300, 360 KB: aligned) -> Add(b 300 floats, 1.2 KB) -> MatMul(W2 300x7 fp16) -> y,
    plus a Reshape shape constant (small: stays inline) and a 2 MB int8 tensor summed as floats."""
    rng = np.random.default_rng(seed)
    arrays = {"W1": rng.standard_normal((300, 300)).astype(np.float32),
              "b": rng.standard_normal(300).astype(np.float32),
              "W2": rng.standard_normal((300, 7)).astype(np.float16),
              "E": rng.integers(-100, 100, (2048, 1024), dtype=np.int8),
              "shape": np.asarray([1, 7], dtype=np.int64)}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Cast", ["hb"], ["h16"], to=TensorProto.FLOAT16),
             helper.make_node("MatMul", ["h16", "W2"], ["y16"]), helper.make_node("Reshape", ["y16", "shape"], ["y"]),
             helper.make_node("Cast", ["E"], ["Ef"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["Ef"], ["e"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 300])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 7]),
                               helper.make_tensor_value_info("e", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(a, n) for n, a in arrays.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), arrays


def _run(session_or_model, x):
    session = session_or_model if hasattr(session_or_model, "run") else onnx_io.ort_session(session_or_model)
    return session.run(None, {"x": x})


def test_save_writes_one_data_file_with_aligned_big_tensors(tmp_path):
    model, arrays = _model()
    x = np.random.default_rng(1).standard_normal((1, 300)).astype(np.float32)
    want = _run(model, x)
    path = onnx_io.save(model, tmp_path / "m.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    onnx.checker.check_model(str(path))  # by path: the data file is where the model says
    on_disk = onnx.load(str(path), load_external_data=False)
    where = {t.name: dict((e.key, e.value) for e in t.external_data) for t in on_disk.graph.initializer}
    assert where["shape"] == {}  # 16 bytes: inline
    for name in ("W1", "b", "W2", "E"):
        assert where[name]["location"] == "m.onnx.data", name
    assert int(where["E"]["offset"]) % onnx_io.DATA_ALIGNMENT == 0  # >= 1 MiB: aligned for memory mapping
    assert os.path.getsize(path) < 2000  # the graph file carries no weights
    # the saved model refers to the saved file now (no second copy of the inline weights in memory)...
    assert all(onnx_io.is_external(t) for t in model.graph.initializer if t.name != "shape")
    np.testing.assert_array_equal(_run(model, x)[0], want[0])
    # ...and a fresh load reads the same values, through memory maps
    loaded = onnx_io.load(path)
    for t in loaded.graph.initializer:
        value = onnx_io.to_array(t)
        np.testing.assert_array_equal(value, arrays[t.name])
        assert isinstance(value, np.memmap) == (t.name != "shape")
    np.testing.assert_array_equal(_run(onnx_io.ort_session(path), x)[0], want[0])  # ONNX Runtime by path
    np.testing.assert_array_equal(_run(loaded, x)[0], want[0])  # ... and from the loaded ModelProto


def test_resave_copies_the_data_and_never_touches_the_input(tmp_path):
    model, _ = _model()
    src = onnx_io.save(model, tmp_path / "a" / "m.onnx")
    before = onnx_io.data_path(src).read_bytes()
    loaded = onnx_io.load(src)
    loaded.graph.node[1].name = "edited"
    out = onnx_io.save(loaded, tmp_path / "b" / "copy.onnx", inputs=[src])
    assert onnx_io.data_path(src).read_bytes() == before
    assert onnx_io.data_path(out).read_bytes() == before  # same tensors, same order, same layout
    assert onnx.load(str(out), load_external_data=False).graph.node[1].name == "edited"
    # writing over the input, or over the data file the model reads from, is refused
    with pytest.raises(UsageError, match="is also an input"):
        onnx_io.save(onnx_io.load(src), src, inputs=[src])
    # a model whose data file happens to be named like the output's: out.onnx would be fine, out.onnx.data is not
    onnx_io.save(onnx_io.load(src), tmp_path / "c" / "out.onnx")
    os.rename(tmp_path / "c" / "out.onnx", tmp_path / "c" / "in.onnx")
    with pytest.raises(UsageError, match=r"output \(its data file\): .*out.onnx.data' is also an input"):
        onnx_io.save(onnx_io.load(tmp_path / "c" / "in.onnx"), tmp_path / "c" / "out.onnx")
    assert (tmp_path / "c" / "out.onnx.data").read_bytes() == before
    assert onnx_io.data_path(src).read_bytes() == before


def test_a_failed_save_leaves_nothing_and_the_model_intact(tmp_path):
    model, _ = _model()
    model.graph.node.append(helper.make_node("NoSuchOp", ["y"], ["z"]))  # onnx.checker refuses it after writing
    original = model.SerializeToString()
    with pytest.raises(onnx.checker.ValidationError):
        onnx_io.save(model, tmp_path / "bad.onnx")
    assert list(tmp_path.iterdir()) == []
    assert model.SerializeToString() == original  # inline weights given back


def test_load_names_missing_or_short_data(tmp_path):
    model, _ = _model()
    path = onnx_io.save(model, tmp_path / "m.onnx")
    data = onnx_io.data_path(path)
    data.rename(tmp_path / "elsewhere")
    with pytest.raises(UsageError, match=r"input: tensor 'W1' keeps its data in 'm.onnx.data', which is missing"):
        onnx_io.load(path)
    (tmp_path / "elsewhere").rename(data)
    with open(data, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(UsageError, match=r"tensor '\w+' needs bytes \d+\.\.\d+ .* which has 1000"):
        onnx_io.load(path)
    (tmp_path / "junk.onnx").write_bytes(b"\x00\xffnot a model")
    with pytest.raises(UsageError, match="is not an ONNX model"):
        onnx_io.load(tmp_path / "junk.onnx", "original")


def test_skeleton_keeps_structure_without_weights(tmp_path):
    model, _ = _model()
    onnx_io.save(model, tmp_path / "m.onnx")
    loaded = onnx_io.load(tmp_path / "m.onnx")
    bare = onnx_io.skeleton(loaded)
    assert [t.name for t in bare.graph.initializer] == ["shape"]
    assert {i.name for i in bare.graph.input} == {"x", "W1", "b", "W2", "E"}
    onnx.checker.check_model(bare)  # in memory: no external locations left to resolve
    inferred = onnx.shape_inference.infer_shapes(bare, strict_mode=True)
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
    assert dims["h"] == [1, 300] and dims["y16"] == [1, 7]


def test_graph_view_reads_weights_lazily_and_evaluates_slices(tmp_path):
    model, arrays = _model()
    onnx_io.save(model, tmp_path / "m.onnx")
    view = GraphView(onnx_io.load(tmp_path / "m.onnx"))
    assert isinstance(view.constant("W1"), np.memmap)
    np.testing.assert_array_equal(view.constant("W2"), arrays["W2"])
    assert view.static_shape("hb") == [1, 300]  # shape inference ran on the skeleton
    h = np.random.default_rng(2).standard_normal((1, 300)).astype(np.float32)
    (y,) = view.evaluate(["y"], {"hb": h}, step=None)  # a probe: only Cast -> MatMul(W2) -> Reshape is run
    np.testing.assert_allclose(y, (h.astype(np.float16) @ arrays["W2"]).reshape(1, 7), rtol=2e-3, atol=2e-3)


def test_in_memory_weights_past_the_protobuf_limit_are_refused_with_the_way_out(monkeypatch):
    model, _ = _model()
    monkeypatch.setattr(onnx_io, "INLINE_LIMIT_BYTES", 4096)
    with pytest.raises(ValueError, match="past the 2 GiB protobuf limit; save it with pagedkv.onnx_io.save"):
        onnx_io.ort_session(model)


def test_16bit_graphs_emulate_and_compare_with_their_weights_on_disk(tmp_path, monkeypatch):
    """rewrite --dtype bf16 -> saved (.onnx + .data) -> compare from the files: the float32 emulation keeps the
    16-bit weights where they are (on disk, behind a Cast that ONNX Runtime folds), so it opens even where the
    limit on weights held in the proto is far below their float32 size (as it is for a 16-bit model past 1 GB)."""
    from pagedkv.builder.compare import compare
    from pagedkv.builder.precision import emulate_in_float32
    from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
    from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic
    from pagedkv.tolerances import MODEL_TOLERANCES

    src = export_synthetic(SyntheticConfig(), tmp_path / "orig.onnx")
    out = onnx_io.save(rewrite_model(src, RewriteOptions(dtype="bf16")).model, tmp_path / "bf16.onnx", inputs=[src])
    loaded = onnx_io.load(out)
    external = {t.name: t.data_type for t in loaded.graph.initializer if onnx_io.is_external(t)}
    assert set(external.values()) == {TensorProto.BFLOAT16}
    emulated = emulate_in_float32(loaded)
    assert {t.name: t.data_type for t in emulated.graph.initializer if onnx_io.is_external(t)} == external
    casts = {n.input[0] for n in emulated.graph.node if n.op_type == "Cast" and n.input[0] in external}
    assert casts == set(external)  # every big weight reaches its readers through one float32 Cast
    float32_bytes = 2 * sum(onnx_io.tensor_bytes(t) for t in loaded.graph.initializer if t.name in external)
    limit = 2 * onnx_io.inline_bytes(loaded) + 1  # the small constants, widened
    assert limit < float32_bytes / 4
    monkeypatch.setattr(onnx_io, "INLINE_LIMIT_BYTES", limit)
    atol, rtol = MODEL_TOLERANCES["bfloat16"]
    report = compare(src, out, prompt_lens=[5, 17], decode_steps=3, atol=atol, rtol=rtol)
    assert report.passed and report.emulated and report.dtypes == ("float32", "bfloat16"), str(report)
    widened = emulate_in_float32(loaded)  # the weights widened in the proto instead: refused under that limit
    for tensor in widened.graph.initializer:
        if tensor.name in external:
            tensor.CopyFrom(numpy_helper.from_array(onnx_io.to_array(tensor).astype(np.float32), tensor.name))
    with pytest.raises(ValueError, match="past the 2 GiB protobuf limit"):
        onnx_io.ort_session(widened)
