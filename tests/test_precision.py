"""dtypes: the conversion of graphs to float16 / bfloat16 (``pagedkv.builder.precision``), ``rewrite --dtype`` and
``compare`` of reduced-precision graphs against the float32 original.

* Every synthetic structure rewrites with ``dtype=fp16|bf16`` into a graph whose plugin activations (qkv, bias,
  q, attention output) are that dtype, a dtype the plugins accept (``pagedkv.config.SUPPORTED_IO_DTYPES``), and
  whose every node agrees on its input types (``check_types``, run by the rewrite besides onnx.checker and
  strict shape inference; checked again here). The Hugging Face families: tests/test_export_hf.py.
* compare: the 16-bit rewritten graph against the float32 original within ``MODEL_TOLERANCES`` (relative to the
  logits' scale), greedy tokens equal, paged K/V equal to the present K/V; also for 16-bit *originals* (the
  rewrite's RoPE / mask / head-mapping probes run on the 16-bit graph).
* The conversion rules on small hand-built graphs: variance in float32 (float16 overflows at 65504), positions in
  float32, weights out of range named, mask sentinels clamped, one-element constants adopted; the type check
  names a node with mixed inputs; the float32 emulation rounds like ml_dtypes.
* TensorRT-RTX (when installed: it is not in CI) parses and builds the converted graph as a strongly typed
  network on this CPU machine, and refuses the float32 one.
"""

from __future__ import annotations

import importlib.util

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pagedkv.builder.compare import compare, default_tolerance
from pagedkv.builder.precision import (DTypeError, check_types, convert_float_dtype, elem_types,
                                       emulate_in_float32)
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.config import (ATTENTION_PLUGIN_NAME, ONNX_DOMAIN, SUPPORTED_IO_DTYPES, WRITE_PLUGIN_NAME, RopeConfig,
                            RopeScaling, RopeStyle)
from pagedkv.onnx_export.synthetic import SyntheticConfig, make_synthetic_model, structure_matrix
from pagedkv.tolerances import MODEL_TOLERANCES

DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
BASE = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)
PROMPTS = [5, 17, 33]
_MODELS: dict = {}


def original(cfg: SyntheticConfig) -> onnx.ModelProto:
    if cfg not in _MODELS:
        _MODELS[cfg] = make_synthetic_model(cfg)
    return _MODELS[cfg]


def plugin_activation_types(model: onnx.ModelProto) -> set[str]:
    """numpy names of every float input/output of every plugin node (qkv, bias, q, attention output)."""
    types = elem_types(model)
    names = set()
    for node in model.graph.node:
        if node.domain == ONNX_DOMAIN and node.op_type in (WRITE_PLUGIN_NAME, ATTENTION_PLUGIN_NAME):
            for t in (*node.input, *node.output):
                if types.get(t) not in (TensorProto.INT32, TensorProto.INT64):
                    names.add(onnx.helper.tensor_dtype_to_np_dtype(types[t]).name)
    return names


# ---- every structure: plugin activations in the dtype the plugins take -------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cfg", structure_matrix(), ids=lambda c: c.id)
def test_plugin_activations_take_the_requested_dtype(cfg, dtype):
    result = rewrite_model(original(cfg), RewriteOptions(dtype=dtype))
    assert plugin_activation_types(result.model) == {DTYPES[dtype]}
    assert DTYPES[dtype] in SUPPORTED_IO_DTYPES
    assert result.report.dtype == DTYPES[dtype] and not result.report.notes
    assert f"float32 -> {DTYPES[dtype]}" in result.report.conversion
    check_types(result.model)
    logits = next(o for o in result.model.graph.output if o.name == "logits")
    assert logits.type.tensor_type.elem_type == onnx.helper.np_dtype_to_tensor_dtype(np.dtype(DTYPES[dtype]))


def test_float32_rewrite_says_it_cannot_be_built():
    result = rewrite_model(original(BASE))
    assert plugin_activation_types(result.model) == {"float32"}
    assert result.report.dtype == "float32"
    assert any("--dtype fp16|bf16" in note for note in result.report.notes)
    assert "note: the plugin activations are float32" in str(result.report)


# ---- compare: 16-bit graphs against the float32 original ----------------------------------------------------
CASES = {
    "gqa": BASE,
    "mqa-bias-fused": BASE.replace(num_kv_heads=1, qkv_bias=True, fused_qkv=True),
    "gptj-partial-table": BASE.replace(num_kv_heads=4, rope_source="table",
                                       rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=32)),
    "window-qknorm-sqrtqk": BASE.replace(sliding_window=8, qk_norm=True, scale_mode="sqrt_qk"),
    "d256-mqa": BASE.replace(head_dim=256, num_heads=2, num_kv_heads=1),
    "contrib-gqa": BASE.replace(attention_form="contrib_gqa"),
    "onnx23": BASE.replace(attention_form="onnx23"),
}


def _assert_passed(report):
    assert report.logits_passed, str(report)
    assert report.greedy_passed, str(report)
    assert report.kv and report.kv_passed, str(report)
    assert report.passed


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_rewritten_16bit_graph_matches_the_float32_original(name, dtype):
    model = original(CASES[name])
    rewritten = rewrite_model(model, RewriteOptions(dtype=dtype)).model
    atol, rtol = MODEL_TOLERANCES[DTYPES[dtype]]
    assert default_tolerance(rewritten, model) == (atol, rtol)
    report = compare(model, rewritten, prompt_lens=PROMPTS, decode_steps=8, chunk_size=8, atol=atol, rtol=rtol)
    _assert_passed(report)
    assert report.dtypes == ("float32", DTYPES[dtype]) and report.emulated
    # a real reduced-precision error, not a float32 graph in disguise: above float32's level by far
    assert max(s.max_scaled for s in report.steps) > 20 * MODEL_TOLERANCES["float32"][1]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", ["gqa", "gptj-partial-table", "window-qknorm-sqrtqk", "contrib-gqa", "onnx23"])
def test_16bit_originals_rewrite_and_match(name, dtype):
    """A graph that is 16-bit before the rewrite: the probes (RoPE, mask, GQA repeat) run on it (bfloat16
    emulated in float32), the plugins keep its dtype, and it still matches the float32 model."""
    model = original(CASES[name])
    narrow, _ = convert_float_dtype(model, dtype)
    result = rewrite_model(narrow)
    assert result.report.dtype == DTYPES[dtype] and not result.report.conversion
    assert [layer.rope for layer in result.report.layers] == [layer.rope for layer in
                                                              rewrite_model(model).report.layers]
    atol, rtol = MODEL_TOLERANCES[DTYPES[dtype]]
    for reference in (model, narrow):
        _assert_passed(compare(reference, result.model, prompt_lens=PROMPTS, decode_steps=8, chunk_size=8,
                               atol=atol, rtol=rtol))


LONGROPE = BASE.replace(num_kv_heads=4, fused_qkv=True, rope=next(
    c.rope for c in structure_matrix() if c.rope.scaling == RopeScaling.LONGROPE))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_16bit_longrope_original_keeps_its_tables_exact(dtype):
    """LongRoPE's Where(max(position_ids) + 1 > N, long, short) between two inverse-frequency constants: exact
    like the position math (float32, unrounded), so the rewrite of the 16-bit graph reads the tables it had (up to
    the 16-bit probes' rounding of the measured factors) and matches both originals."""
    model = original(LONGROPE)
    narrow, _ = convert_float_dtype(model, dtype)
    check_types(narrow)
    tables = {t.name: t for t in narrow.graph.initializer} | \
        {n.output[0]: n.attribute[0].t for n in narrow.graph.node if n.op_type == "Constant"}
    before = {t.name: t for t in model.graph.initializer} | \
        {n.output[0]: n.attribute[0].t for n in model.graph.node if n.op_type == "Constant"}
    for name in ("model.rotary_emb.inv_freq", "model.rotary_emb.long_inv_freq"):
        key = next(k for k in tables if k.endswith(name))
        assert tables[key].data_type == TensorProto.FLOAT, key
        np.testing.assert_array_equal(numpy_helper.to_array(tables[key]), numpy_helper.to_array(before[key]))
    result = rewrite_model(narrow)
    want = rewrite_model(model).report.layers[0].rope
    eps = float(ml_dtypes.finfo(np.dtype(DTYPES[dtype])).eps)
    for layer in result.report.layers:
        got = layer.rope
        assert (got.scaling, got.style, got.rotary_dim, got.original_max_positions) == \
            (want.scaling, want.style, want.rotary_dim, want.original_max_positions)
        for field in ("short_factors", "long_factors"):
            np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=eps, err_msg=field)
        assert got.attention_factor == pytest.approx(want.attention_factor, rel=eps)
    atol, rtol = MODEL_TOLERANCES[DTYPES[dtype]]
    for reference in (model, narrow):
        _assert_passed(compare(reference, result.model, prompt_lens=PROMPTS, decode_steps=8, chunk_size=8,
                               atol=atol, rtol=rtol))


def test_compare_catches_a_wrong_16bit_rewrite():
    """The 16-bit tolerance is loose next to float32's, but a wrong RoPE theta still fails by far."""
    model = original(BASE)
    rewritten = rewrite_model(model, RewriteOptions(dtype="bf16")).model
    for node in rewritten.graph.node:
        if node.op_type == WRITE_PLUGIN_NAME:
            for a in node.attribute:
                if a.name == "rope_theta":
                    a.f = 500.0
    atol, rtol = MODEL_TOLERANCES["bfloat16"]
    report = compare(model, rewritten, prompt_lens=PROMPTS, decode_steps=2, atol=atol, rtol=rtol)
    assert not report.logits_passed and max(s.max_scaled for s in report.steps) > 2 * rtol


# ---- the conversion rules on hand-built graphs ----------------------------------------------------------
def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model, feeds):
    session = ort.InferenceSession(emulate_in_float32(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _rms_norm_model(cast: bool):
    """x [1, 4, 64] -> weight * x / sqrt(mean(x^2) + eps): the dynamo form (no casts) or the legacy form with
    the float32 model's no-op Cast(to=FLOAT) pair (transformers' RMSNorm)."""
    f = TensorProto.FLOAT
    nodes, x = [], "x"
    if cast:
        nodes.append(helper.make_node("Cast", ["x"], ["xf"], to=f, name="cast_in"))
        x = "xf"
    nodes += [helper.make_node("Pow", [x, "two"], ["sq"], name="pow"),
              helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1], keepdims=1, name="mean"),
              helper.make_node("Add", ["var", "eps"], ["var_eps"], name="add_eps"),
              helper.make_node("Sqrt", ["var_eps"], ["std"], name="sqrt"),
              helper.make_node("Div", ["one", "std"], ["inv"], name="inv"),
              helper.make_node("Mul", [x, "inv"], ["normed"], name="normalize")]
    if cast:
        nodes.append(helper.make_node("Cast", ["normed"], ["normed_cast"], to=f, name="cast_out"))
    nodes.append(helper.make_node("Mul", ["weight", "normed_cast" if cast else "normed"], ["y"], name="scale"))
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.float32(2.0), "two"), numpy_helper.from_array(np.float32(1e-6), "eps"),
             numpy_helper.from_array(np.float32(1.0), "one"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(64)).astype(np.float32), "weight")]
    return _model(nodes, [helper.make_tensor_value_info("x", f, [1, 4, 64])],
                  [helper.make_tensor_value_info("y", f, [1, 4, 64])], inits)


@pytest.mark.parametrize("cast", [False, True], ids=["dynamo-no-casts", "legacy-casts"])
def test_variance_stays_float32_where_float16_would_overflow(cast):
    model = _rms_norm_model(cast)
    converted, report = convert_float_dtype(model, "fp16")
    check_types(converted)
    types = elem_types(converted)
    assert types["var"] == TensorProto.FLOAT and types["std"] == TensorProto.FLOAT  # the island
    assert types["y"] == TensorProto.FLOAT16 and types["weight"] == TensorProto.FLOAT16  # the model
    assert any(n.startswith("ReduceMean|") for n in report.float32_nodes)
    # activations of a few hundred: x^2 overflows float16 (65504), the float32 variance does not
    x = (np.random.default_rng(1).standard_normal((1, 4, 64)) * 400).astype(np.float32)
    assert np.isinf(np.square(x.astype(np.float16))).any()
    (y,) = _run(converted, {"x": x.astype(np.float16).astype(np.float32)})
    x64 = x.astype(np.float16).astype(np.float64)
    weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "weight")).astype(np.float64)
    want = weight * x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + 1e-6)
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, want, rtol=4e-3, atol=4e-3 * np.abs(want).max())


def test_positions_stay_float32_past_float16s_range():
    """Rotary angles from integer positions: exact values, computed in float32, cast where they meet q."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [helper.make_node("Cast", ["pos"], ["pos_f"], to=f, name="cast_pos"),
             helper.make_node("Mul", ["pos_f", "inv_freq"], ["angle"], name="angle"),
             helper.make_node("Cos", ["angle"], ["cos"], name="cos"),
             helper.make_node("Mul", ["q", "cos"], ["y"], name="q_cos")]
    inv_freq = np.asarray([1.0, 0.01, 1e-4], np.float32)
    model = _model(nodes, [helper.make_tensor_value_info("pos", i64, [3]), helper.make_tensor_value_info("q", f, [3])],
                   [helper.make_tensor_value_info("y", f, [3])], [numpy_helper.from_array(inv_freq, "inv_freq")])
    converted, _ = convert_float_dtype(model, "fp16")
    check_types(converted)
    types = elem_types(converted)
    assert types["angle"] == TensorProto.FLOAT and types["y"] == TensorProto.FLOAT16
    assert numpy_helper.to_array(next(t for t in converted.graph.initializer if t.name == "inv_freq")).dtype == \
        np.float32
    pos = np.asarray([70000, 70001, 3], np.int64)  # past float16's 65504
    (y,) = _run(converted, {"pos": pos, "q": np.ones(3, np.float32)})
    want = np.cos(pos.astype(np.float32) * inv_freq)
    np.testing.assert_allclose(y, want.astype(np.float16).astype(np.float32), atol=1e-3)


def test_weights_out_of_range_are_named_and_mask_sentinels_clamped():
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Add", ["x", "big"], ["y"], name="add_big")]
    big = numpy_helper.from_array(np.asarray([1.0, 7e4], np.float32), "big")
    model = _model(nodes, [helper.make_tensor_value_info("x", f, [2])], [helper.make_tensor_value_info("y", f, [2])],
                   [big])
    with pytest.raises(DTypeError, match=r"big: holds values up to 70000.*float16's range"):
        convert_float_dtype(model, "fp16")
    converted, _ = convert_float_dtype(model, "bf16")  # bfloat16 has float32's range
    check_types(converted)
    mask = numpy_helper.from_array(np.asarray([0.0, np.finfo(np.float32).min], np.float32), "mask")
    masked = _model([helper.make_node("Add", ["x", "mask"], ["y"], name="add_mask")],
                    [helper.make_tensor_value_info("x", f, [2])], [helper.make_tensor_value_info("y", f, [2])],
                    [mask])
    for dtype, np_dtype in (("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        converted, _ = convert_float_dtype(masked, dtype)
        value = numpy_helper.to_array(converted.graph.initializer[0])
        assert value.dtype == np_dtype and np.isfinite(value).all()
        assert float(value[1]) == -float(ml_dtypes.finfo(np_dtype).max)


def test_one_element_constants_take_their_readers_dtype():
    """eps read by an island op stays float32, the same scalar read by a model op becomes float16: one copy."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=f, name="up"),
             helper.make_node("Add", ["xf", "c"], ["island"], name="island_add"),
             helper.make_node("Mul", ["x", "c"], ["model"], name="model_mul"),
             helper.make_node("Add", ["island", "model"], ["y"], name="meet")]
    model = _model(nodes, [helper.make_tensor_value_info("x", f, [2])], [helper.make_tensor_value_info("y", f, [2])],
                   [numpy_helper.from_array(np.float32(0.5), "c")])
    converted, _ = convert_float_dtype(model, "fp16")
    check_types(converted)
    readers = {n.name: n for n in converted.graph.node}
    inits = {t.name: t.data_type for t in converted.graph.initializer}
    assert inits[readers["island_add"].input[1]] == TensorProto.FLOAT
    assert inits[readers["model_mul"].input[1]] == TensorProto.FLOAT16
    assert len(inits) == 2
    (y,) = _run(converted, {"x": np.asarray([1.0, -2.0], np.float32)})
    np.testing.assert_allclose(y, [2.0, -2.5])  # (x + 0.5) + x * 0.5


def test_check_types_names_the_node_with_mixed_inputs():
    f, h = TensorProto.FLOAT, TensorProto.FLOAT16
    model = _model([helper.make_node("Add", ["a", "b"], ["y"], name="the_add")],
                   [helper.make_tensor_value_info("a", f, [2]), helper.make_tensor_value_info("b", h, [2])],
                   [helper.make_tensor_value_info("y", f, [2])])
    with pytest.raises(DTypeError, match=r"Add node 'the_add': 'a' is float32 but 'b' is float16"):
        check_types(model)
    pow_model = _model([helper.make_node("Pow", ["a", "b"], ["y"], name="the_pow")],
                       [helper.make_tensor_value_info("a", h, [2]), helper.make_tensor_value_info("b", f, [2])],
                       [helper.make_tensor_value_info("y", h, [2])])
    onnx.checker.check_model(pow_model)  # ONNX allows Pow's exponent its own type; TensorRT does not
    with pytest.raises(DTypeError, match="the_pow"):
        check_types(pow_model)


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_emulation_rounds_each_result_like_ml_dtypes(dtype):
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    nodes = [helper.make_node("Mul", ["a", "b"], ["p"], name="mul"),
             helper.make_node("Add", ["p", "a"], ["y"], name="add")]
    model = _model(nodes, [helper.make_tensor_value_info(n, dtype, [64]) for n in ("a", "b")],
                   [helper.make_tensor_value_info("y", dtype, [64])])
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(64).astype(np_dtype) for _ in range(2))
    (y,) = _run(model, {"a": a.astype(np.float32), "b": b.astype(np.float32)})
    p = (a.astype(np.float32) * b.astype(np.float32)).astype(np_dtype)
    want = (p.astype(np.float32) + a.astype(np.float32)).astype(np_dtype).astype(np.float32)
    np.testing.assert_array_equal(y, want)
    float32 = _rms_norm_model(cast=False)
    assert emulate_in_float32(float32) is float32  # nothing to emulate: the model itself


def test_conversion_leaves_the_input_untouched_and_float32_is_a_round_trip():
    model = original(BASE)
    before = model.SerializeToString()
    narrow, _ = convert_float_dtype(model, "fp16")
    assert model.SerializeToString() == before
    wide, report = convert_float_dtype(narrow, "fp32")
    check_types(wide)
    assert report.source == "float16" and report.target == "float32"
    assert {t.data_type for t in wide.graph.initializer} <= {TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32}


# ---- TensorRT-RTX: a real strongly typed parse + build, on this CPU machine --------------------------------
def _tensorrt_rtx_missing() -> str | None:
    if importlib.util.find_spec("tensorrt_rtx") is None:
        return "tensorrt_rtx not installed (pip install tensorrt_rtx_cu13==1.7.1.116; CI installs it)"
    from pagedkv import _lib

    try:
        _lib.plugin_library_path()
    except Exception as exc:  # noqa: BLE001 - the reason is the skip message
        return f"plugin library unavailable: {exc}"
    return None


@pytest.mark.skipif(_tensorrt_rtx_missing() is not None, reason=str(_tensorrt_rtx_missing()))
@pytest.mark.parametrize("dtype", ["fp16", "bf16", None], ids=["fp16", "bf16", "float32"])
def test_tensorrt_rtx_builds_the_converted_graph(dtype, tmp_path):
    from pagedkv import _lib, trt_library

    trt = trt_library.import_flavour(trt_library.TENSORRT_RTX)  # with libtensorrt_rtx.so beside the library

    path = tmp_path / "paged.onnx"
    onnx.save(rewrite_model(original(BASE), RewriteOptions(dtype=dtype)).model, str(path))
    logger = trt.Logger(trt.Logger.ERROR)
    trt.get_plugin_registry().load_library(str(_lib.plugin_library_path()))
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # strongly typed
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(path)), [parser.get_error(i).desc() for i in range(parser.num_errors)]
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        shape = list(network.get_input(i).shape)
        profile.set_shape(network.get_input(i).name, *([d if d >= 0 else n for d in shape] for n in (1, 8, 64)))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if dtype is None:  # the plugins take no float32 activations: no tactic, no engine
        assert plan is None
    else:
        assert plan is not None and plan.nbytes > 0
