"""Hugging Face export (tiny configs, random weights, offline) -> rewrite -> compare: every family, both PyTorch
exporters (legacy opset 17, dynamo opset 20 and 23), both of transformers' attention implementations (sdpa, the
default, and eager) where the family has them.

Each cell: ``export_hf`` (which itself checks ONNX Runtime against eager PyTorch on four shapes other than the
traced one), then ``conftest.rewrite_and_compare``: a ragged batch (5, 17, 33 tokens) in 8-token prefill chunks (so
steps mix prefill chunks and decodes) and 8 greedy decode steps: logits within the fp16-cache tolerance on the
logits' scale, identical greedy tokens, paged K/V equal to the present K/V.

Also: the legacy export run through ONNX Runtime's transformer optimizer before the rewrite, and per-family checks
that read the rewrite's report of the families that exercise a RoPE scaling, the soft-cap or absolute positions
(gpt2, phi3, qwen2_yarn, gemma2). Cells whose graph the rewrite does not recognize go into REWRITE_GAPS: strict
xfails that must raise RewriteError, so a cell that starts to pass (or fails differently) turns red until the entry
is removed. Cells that cannot exist are in NOT_APPLICABLE, each with a test that the reason still holds. Skipped as
a whole only when torch / transformers are not installed (the ``export`` extra). The other exporters' matrix is
tests/test_exporters.py.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from conftest import MATRIX_PROMPTS, NOT_APPLICABLE, TOLERANCES, rewrite_and_compare
from conftest import hf_export as _export

from pagedkv.onnx_export import hf
from pagedkv.onnx_export._hf_families import FAMILIES
from pagedkv.tolerances import EXPORT_FLOAT32_TOLERANCE

NO_EXPORT = hf.why_export_unavailable()
needs_export = pytest.mark.skipif(NO_EXPORT is not None, reason=f"export extra missing: {NO_EXPORT}")

# (exporter, opset): the matrix's exporters. The dynamo exporter at opset 23 writes SDPA as the standard Attention
# op (fed by the Concat'ed, repeated caches) and RoPE as RotaryEmbedding; below 23 it decomposes SDPA.
EXPORTS = (("legacy", 17), ("dynamo", 20), ("dynamo", 23))
ATTENTION_PATTERN = {("dynamo", 23, "sdpa"): "onnx_attention"}  # else "decomposed"
WINDOWS = {"mistral": {8}, "gemma2": {8, 0}}  # the sliding windows of the tiny configs (gemma2: every other layer)

# (family, exporter, opset, attention) -> what the rewrite reports today. Empty: every cell passes. Example:
#   ("qwen3", "dynamo", 20, "sdpa"): "past_value still read outside attention by a Shape node",
REWRITE_GAPS: dict[tuple, str] = {}


def _rewrite_error():
    from pagedkv.builder.rewrite import RewriteError

    return RewriteError


def _cells():
    for exporter, opset in EXPORTS:
        for attention in hf.ATTENTION_IMPLEMENTATIONS:
            for family in FAMILIES:
                if (family, attention) in NOT_APPLICABLE:
                    continue
                marks = [needs_export]
                gap = REWRITE_GAPS.get((family, exporter, opset, attention))
                if gap:
                    marks.append(pytest.mark.xfail(strict=True, raises=_rewrite_error(), reason=f"rewrite gap: {gap}"))
                yield pytest.param(family, exporter, opset, attention, marks=marks,
                                   id=f"{family}-{exporter}{opset}-{attention}")


@pytest.mark.parametrize("family,exporter,opset,attention", list(_cells()))
def test_export_rewrite_compare(family, exporter, opset, attention, tmp_path_factory):
    result = _export(family, exporter, tmp_path_factory, opset, attention)
    assert result.verify_max_abs_err is not None and result.verify_max_abs_err <= EXPORT_FLOAT32_TOLERANCE[0]
    if (exporter, opset, attention) == ("dynamo", 23, "sdpa"):  # the standard ops, past concatenated outside
        graph = onnx.load(str(result.path), load_external_data=False).graph
        attention_ops = [n for n in graph.node if n.op_type == "Attention"]
        assert len(attention_ops) == result.num_layers
        assert all(len([i for i in n.input if i]) == 4 for n in attention_ops)  # q, k, v, mask
    rewritten = rewrite_and_compare(result.path, f"{family}/{exporter} opset {opset}/{attention}")
    want = ATTENTION_PATTERN.get((exporter, opset, attention), "decomposed")
    assert [r.pattern for r in rewritten.report.layers] == [want] * result.num_layers
    assert not {n.op_type for n in rewritten.model.graph.node} & {"Attention", "RotaryEmbedding", "Softmax"}
    assert {r.window for r in rewritten.report.layers} == WINDOWS.get(family, {0})


@needs_export
@pytest.mark.parametrize("family,attn", list(NOT_APPLICABLE))
def test_not_applicable_cells_still_are(family, attn):
    """The excluded cells are excluded for the stated reason: when transformers starts accepting one, this fails
    and the cell joins the matrix."""
    with pytest.raises(ValueError, match="does not support an attention implementation"):
        hf.load_model(family, attn_implementation=attn)


# ---- what the rewrite reads off the new families (legacy export, eager) -------------------------------------
def _report(family, tmp_path_factory):
    from pagedkv.builder.rewrite import RewriteOptions, rewrite_model

    result = _export(family, "legacy", tmp_path_factory, attention="eager")
    return result, rewrite_model(str(result.path), RewriteOptions())


@needs_export
def test_gpt2_learned_positions_gemm_projection_no_rope(tmp_path_factory):
    _, rewritten = _report("gpt2", tmp_path_factory)
    report = rewritten.report
    assert report.explicit_positions  # the position-embedding Gather reads position_ids outside attention
    for layer in report.layers:
        assert layer.rope.style.name == "NONE" and layer.qkv_bias and layer.fused_qkv and layer.projection == "packed"
        assert layer.softmax_scale == pytest.approx(64 ** -0.5)
    wpe = [n for n in rewritten.model.graph.node if n.op_type == "Gather" and "wpe" in n.input[0]]
    assert len(wpe) == 1  # kept, now fed by the engine's position_ids


@needs_export
def test_phi3_traceable_rope_skips_the_update_whatever_decorates_the_forward(tmp_path, monkeypatch):
    """Some transformers versions put torch.no_grad above dynamic_rope_update on the rotary forward (the GPU
    machine's did, and dynamo failed in the update's data-dependent branch): while exporting, the update must
    not run however many decorators sit above it, and the export still verifies."""
    import functools

    import torch
    from transformers.models.phi3 import modeling_phi3

    from pagedkv.onnx_export._hf_wrapper import traceable_rope

    update_calls = []
    with_update = modeling_phi3.Phi3RotaryEmbedding.forward  # dynamic_rope_update's wrapper

    @functools.wraps(with_update)
    def counted(*args, **kwargs):
        update_calls.append(1)
        return with_update(*args, **kwargs)

    monkeypatch.setattr(modeling_phi3.Phi3RotaryEmbedding, "forward", torch.no_grad()(counted))
    model = hf.load_model("phi3")
    ids = torch.arange(20).reshape(1, 20)
    with torch.no_grad(), traceable_rope(model):
        model(input_ids=ids)
    assert not update_calls, "the traceable forward went through dynamic_rope_update"
    model(input_ids=ids)
    assert update_calls, "outside the export the model's own forward runs"
    result = hf.export_hf("phi3", tmp_path / "phi3.onnx", exporter="dynamo")
    assert result.verify_max_abs_err is not None and result.verify_max_abs_err < 1e-4, str(result)


@needs_export
def test_phi3_longrope_tables_and_switch_are_read_off_the_graph(tmp_path_factory):
    from pagedkv.builder.compare import compare
    from pagedkv.onnx_export._hf_families import PHI3_ORIGINAL_MAX_POSITIONS, tiny_config
    from pagedkv.reference.rope import attention_factor

    result, rewritten = _report("phi3", tmp_path_factory)
    params = tiny_config("phi3").rope_parameters
    for layer in rewritten.report.layers:
        rope = layer.rope
        assert rope.scaling.name == "LONGROPE" and rope.original_max_positions == PHI3_ORIGINAL_MAX_POSITIONS
        np.testing.assert_allclose(rope.short_factors, params["short_factor"], rtol=2e-6)
        np.testing.assert_allclose(rope.long_factors, params["long_factor"], rtol=2e-6)
        factor = tiny_config("phi3").max_position_embeddings / PHI3_ORIGINAL_MAX_POSITIONS
        assert attention_factor(rope) == pytest.approx(
            np.sqrt(1 + np.log(factor) / np.log(PHI3_ORIGINAL_MAX_POSITIONS)), rel=1e-6)
        assert layer.fused_qkv and layer.num_kv_heads == 1
    # the prompts (5, 17, 33) start on both sides of the switch at 12; one kv length later, compare fails
    assert min(MATRIX_PROMPTS) < PHI3_ORIGINAL_MAX_POSITIONS < max(MATRIX_PROMPTS)
    for node in rewritten.model.graph.node:
        for attr in node.attribute:
            if attr.name == "rope_original_max_positions":
                attr.i = PHI3_ORIGINAL_MAX_POSITIONS + 1
    report = compare(str(result.path), rewritten.model, prompt_lens=MATRIX_PROMPTS, decode_steps=8, chunk_size=8,
                     atol=TOLERANCES["float16"][0], rtol=TOLERANCES["float16"][1])
    assert not report.logits_passed


@needs_export
def test_qwen2_yarn_parameters_are_read_off_the_graph(tmp_path_factory):
    from pagedkv.config import RopeConfig, RopeScaling
    from pagedkv.onnx_export._hf_families import tiny_config

    _, rewritten = _report("qwen2_yarn", tmp_path_factory)
    params = tiny_config("qwen2_yarn").rope_parameters
    want = RopeConfig(theta=params["rope_theta"], scaling=RopeScaling.YARN, factor=params["factor"],
                      original_max_positions=params["original_max_position_embeddings"],
                      beta_fast=params["beta_fast"], beta_slow=params["beta_slow"])
    assert [layer.rope for layer in rewritten.report.layers] == [want] * 2  # attention factor: the default


@needs_export
def test_gemma2_softcap_and_alternating_windows(tmp_path_factory):
    from pagedkv.onnx_export._hf_families import tiny_config

    _, rewritten = _report("gemma2", tmp_path_factory)
    config = tiny_config("gemma2")
    layers = rewritten.report.layers
    assert [layer.window for layer in layers] == [config.sliding_window, 0]  # layer_types: sliding, full
    assert [layer.pool_group for layer in layers] == [0, 1] and len(rewritten.pool_groups) == 2
    for layer in layers:
        assert layer.logit_softcap == config.attn_logit_softcapping
        assert layer.softmax_scale == pytest.approx(config.query_pre_attn_scalar ** -0.5, rel=1e-6)


# ONNX Runtime's transformer optimizer on the legacy export, before the rewrite. In onnxruntime 1.32 there is no
# llama model type; "gpt2" (Gpt2OnnxModel: FusionRotaryAttention, RotaryEmbedding, the layer norms) is what its
# llama scripts use. On transformers 5 exports it fuses no attention-related op: FusionRotaryEmbeddings looks
# for sin/cos caches gathered by position ids, while transformers computes cos/sin from inv_freq x positions
# ("failed to match sin path in apply_rope"), and the rotary attention fusion needs the fused rotary. What it
# does fuse (the RMSNorms, the residual adds into them, GELU) sits outside attention and must stay untouched.
# The default opt_level (1 for gpt2: ORT's basic graph optimizations run too; their common-subexpression
# elimination makes layer 1's RoPE read a Shape whose source runs through layer 0, which measure_rope cuts off
# by feeding the layer's hidden state). family -> the fused-op statistics expected.
NORMS = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 4}
GELU_LN = {"LayerNormalization": 1, "SkipLayerNormalization": 2, "FastGelu": 2}
ORT_OPTIMIZER_FAMILIES = {
    "llama": NORMS,
    "mistral": NORMS,
    "qwen2": NORMS,
    "qwen3": {"SimplifiedLayerNormalization": 5, "SkipSimplifiedLayerNormalization": 4},  # + 4 q/k head norms
    "gemma": {**NORMS, "FastGelu": 2},
    "phi": GELU_LN,
    "gptj": GELU_LN,
    "gpt_neox": {"LayerNormalization": 3, "SkipLayerNormalization": 2, "BiasGelu": 2},  # parallel residual
}
ATTENTION_FUSIONS = ("Attention", "MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding")


@needs_export
@pytest.mark.parametrize("family", list(ORT_OPTIMIZER_FAMILIES))
def test_ort_transformer_optimizer_then_rewrite(family, tmp_path_factory):
    from onnxruntime.transformers import optimizer

    from pagedkv.onnx_export._hf_families import tiny_config

    exported = _export(family, "legacy", tmp_path_factory, attention="eager")
    config = tiny_config(family)
    optimized = optimizer.optimize_model(str(exported.path), model_type="gpt2", num_heads=config.num_attention_heads,
                                         hidden_size=config.hidden_size)
    fused = {op: count for op, count in optimized.get_fused_operator_statistics().items() if count}
    assert fused == ORT_OPTIMIZER_FAMILIES[family]
    ops = [(n.domain, n.op_type) for n in optimized.model.graph.node]
    assert not [op for op in ops if op[1] in ATTENTION_FUSIONS]  # nothing attention-related was fused
    path = tmp_path_factory.mktemp("ort") / f"{family}_legacy_ort.onnx"
    optimized.save_model_to_file(str(path))
    rewritten = rewrite_and_compare(path, f"{family}/legacy + ORT optimizer")
    assert [r.pattern for r in rewritten.report.layers] == ["decomposed"] * exported.num_layers
    after = [(n.domain, n.op_type) for n in rewritten.model.graph.node]
    for op in {op for op in ops if op[1] in fused}:  # the fused norms / GELUs are kept as they are
        assert after.count(op) == ops.count(op), op  # (qwen3's q/k head norms stay in the kept q/k chains)


@needs_export
@pytest.mark.parametrize("exporter", hf.EXPORTERS)
def test_exported_graph_follows_the_convention(exporter, tmp_path_factory):
    result = _export("llama", exporter, tmp_path_factory)
    model = onnx.load(str(result.path), load_external_data=False)
    assert sorted(p.name for p in result.path.parent.iterdir() if p.name.startswith(result.path.name)) == [
        result.path.name, result.path.name + ".data"]  # the graph and its one data file, nothing else
    inputs = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    outputs = [o.name for o in model.graph.output]
    assert inputs == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key",
                      "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]
    assert outputs == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    past = model.graph.input[3].type.tensor_type.shape.dim
    assert [d.dim_value for d in past][1::2] == [2, 64]  # kv_heads, head_dim static; batch/past symbolic
    assert not past[0].HasField("dim_value") and not past[2].HasField("dim_value")
    assert (result.num_layers, result.num_kv_heads, result.head_dim) == (2, 2, 64)
    assert result.opset == hf.DEFAULT_OPSET[exporter]
    assert any(o.domain in ("", "ai.onnx") and o.version == result.opset for o in model.opset_import)


@needs_export
def test_export_runs_offline_and_weights_are_random_but_reproducible(tmp_path):
    import os

    a = hf.load_model("qwen2", seed=5)
    b = hf.load_model("qwen2", seed=5)
    c = hf.load_model("qwen2", seed=6)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    name = next(n for n in pa if "q_proj.bias" in n)
    assert np.array_equal(pa[name].detach().numpy(), pb[name].detach().numpy())
    assert not np.array_equal(pa[name].detach().numpy(), pc[name].detach().numpy())
    assert np.abs(pa[name].detach().numpy()).max() > 0  # biases are non-trivial (transformers zeroes them)


@needs_export
def test_unknown_source_and_exporter_are_named(tmp_path):
    from pagedkv.onnx_export._hf_families import tiny_config

    with pytest.raises(ValueError, match="family: unknown value 'bloom'"):
        tiny_config("bloom")
    with pytest.raises(ValueError, match="neither a family"):
        hf.load_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="exporter: expected one of"):
        hf.export_model(hf.load_model("llama"), tmp_path / "x.onnx", exporter="jit")


def test_missing_torch_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(hf.MissingExportDependencies, match=r"torch.*pip install 'pagedkv\[export\]'"):
        hf.require_export_deps()
    assert "torch" in hf.why_export_unavailable()


@needs_export
def test_cli_export(tmp_path, capsys, monkeypatch):
    import pagedkv.userio
    from pagedkv.cli import main

    # progress as on a terminal: each step named on the bar (stderr), the report on stdout
    monkeypatch.setattr(pagedkv.userio, "progress_enabled", lambda quiet=False: not quiet)
    out = tmp_path / "phi.onnx"
    assert main(["export", "--family", "phi", "-o", str(out), "--exporter", "legacy"]) == 0
    captured = capsys.readouterr()
    assert out.is_file() and "verified vs eager" in captured.out
    for step in ("pagedkv export", "load phi", "legacy export (", "verify against eager PyTorch on 4 shapes",
                 "write phi.onnx and phi.onnx.data"):
        assert step in captured.err, (step, captured.err)
    assert main(["export", "--family", "phi", "-o", str(tmp_path / "q.onnx"), "--quiet", "--no-verify"]) == 0
    assert capsys.readouterr().err == ""


# ---- dtypes and quantized caches on every family ---------------------------------------------------------
# rewrite --dtype fp16|bf16 of the float32 export: the plugins' activations in that dtype (a dtype of the
# capability table), then compare against the float32 original with the dtype's stated tolerance
# (pagedkv.tolerances.MODEL_TOLERANCES, relative to the logits' scale).
@needs_export
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rewrite_dtype_every_family(family, dtype, tmp_path_factory):
    from pagedkv.builder.compare import compare
    from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
    from pagedkv.config import SUPPORTED_IO_DTYPES
    from test_precision import plugin_activation_types

    from pagedkv.tolerances import MODEL_TOLERANCES

    exported = _export(family, "legacy", tmp_path_factory)
    result = rewrite_model(str(exported.path), RewriteOptions(dtype=dtype))
    name = {"fp16": "float16", "bf16": "bfloat16"}[dtype]
    assert plugin_activation_types(result.model) == {name} and name in SUPPORTED_IO_DTYPES
    atol, rtol = MODEL_TOLERANCES[name]
    report = compare(str(exported.path), result.model, prompt_lens=MATRIX_PROMPTS, decode_steps=8, chunk_size=8,
                     atol=atol, rtol=rtol)
    print(f"{family} --dtype {dtype}: logits {max(s.max_scaled for s in report.steps):.2e} of the scale")
    assert report.passed, str(report)


# fp8 / int8 caches with per-layer scales calibrated on the float32 original (random-token prompts), compared
# with the CLI's default tolerance (compare.default_tolerance).
FP8_BEYOND_DEFAULT_TOLERANCE = {("phi3", "fp8"): 0.5, ("qwen2_yarn", "fp8"): 0.3}  # worst scaled logits error
@needs_export
@pytest.mark.parametrize("cache", ["fp8", "int8"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_calibrated_quantized_cache_every_family(family, cache, tmp_path_factory):
    from pagedkv.builder.calibrate import CalibrationPlan
    from pagedkv.builder.compare import compare, default_tolerance
    from pagedkv.builder.rewrite import RewriteOptions, rewrite_model

    exported = _export(family, "legacy", tmp_path_factory)
    rewritten = rewrite_model(str(exported.path), RewriteOptions(cache_dtype=cache, calibration=CalibrationPlan()),
                              quiet=True).model
    atol, rtol = default_tolerance(rewritten, str(exported.path))
    report = compare(str(exported.path), rewritten, prompt_lens=MATRIX_PROMPTS, decode_steps=8, chunk_size=8,
                     atol=atol, rtol=rtol)
    worst = max(s.max_scaled for s in report.steps)
    print(f"{family} {cache}: logits {worst:.2e} of the scale (bound {atol:g})")
    if (family, cache) in FP8_BEYOND_DEFAULT_TOLERANCE:
        # Known, measured (0.39 / 0.17 of the logits' scale): e4m3's 3 mantissa bits on K, with the tiny configs'
        # attention factor (1.58 / 1.14) multiplying q and k, move the attention logits beyond the CLI default. The
        # int8 cache passes it; docs/builder.md says so. Held here below a bound, so that it cannot get worse.
        assert not report.passed and worst < FP8_BEYOND_DEFAULT_TOLERANCE[family, cache], str(report)
    else:
        assert report.passed, str(report)


# export --dtype float16|bfloat16: verified against the float32 model with the same weights, then the rewrite of
# the 16-bit graph itself (its probes run on it) compared with the float32 export.
@needs_export
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gptj"])
def test_export_16bit_verifies_and_rewrites(family, dtype, tmp_path, tmp_path_factory):
    from pagedkv.builder.compare import compare
    from pagedkv.builder.precision import check_types
    from pagedkv.builder.rewrite import rewrite_model
    from pagedkv.tolerances import MODEL_TOLERANCES

    result = hf.export_hf(family, tmp_path / f"{family}_{dtype}.onnx", exporter="legacy", dtype=dtype,
                          attn_implementation="eager")  # sdpa: test_16bit_sdpa_export_failure_names_the_way_out
    assert result.dtype == dtype and result.verify_max_abs_err is not None
    assert "verified vs eager float32 with the same weights" in str(result)
    graph = onnx.load(str(result.path))
    check_types(graph)
    if family != "gptj":  # rotary inv_freq stays float32, unrounded (module docstring); GPT-J has a sin/cos table
        from onnx import numpy_helper

        exact = (1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
        tensors = list(graph.graph.initializer) + [n.attribute[0].t for n in graph.graph.node
                                                   if n.op_type == "Constant" and n.attribute[0].name == "value"]
        float32 = [numpy_helper.to_array(t).ravel() for t in tensors if t.data_type == onnx.TensorProto.FLOAT]
        assert any(v.shape == exact.shape and np.allclose(v, exact, rtol=1e-6, atol=0) for v in float32)  # fp16: ~1e-4
    rewritten = rewrite_model(str(result.path))
    assert rewritten.report.dtype == dtype
    float32 = _export(family, "legacy", tmp_path_factory)
    atol, rtol = MODEL_TOLERANCES[dtype]
    for reference in (str(float32.path), str(result.path)):
        report = compare(reference, rewritten.model, prompt_lens=MATRIX_PROMPTS, decode_steps=8, chunk_size=8,
                         atol=atol, rtol=rtol)
        assert report.passed, str(report)


@needs_export
def test_16bit_export_that_computes_something_else_is_diagnosed_and_leaves_nothing(tmp_path, monkeypatch):
    """The verification's diagnosis: a graph of other weights is far from the model, eager PyTorch in the same
    dtype is not: 'computes something else', not rounding. And a failed export leaves no file behind."""
    import torch

    from pagedkv.onnx_export._hf_wrapper import DecoderWithPast

    path = tmp_path / "llama16.onnx"
    hf.export_hf("llama", path, exporter="legacy", dtype="float16", seed=0, attn_implementation="eager")
    other = hf.load_model("llama", seed=1, dtype="float16")
    with pytest.raises(hf.ExportError, match=r"is off the float32 model by .* eager PyTorch in float16 only by .*"
                                             r"computes something else than the model"):
        hf._verify_reduced(other, DecoderWithPast(other, 2).eval(), path, path, 2, 2, 64, 128, torch.float16)

    def fail(*args, **kwargs):
        raise hf.ExportError("verification failed on purpose")

    monkeypatch.setattr(hf, "_verify_reduced", fail)
    out = tmp_path / "nothing" / "left.onnx"
    with pytest.raises(hf.ExportError, match="on purpose"):
        hf.export_hf("llama", out, exporter="legacy", dtype="bfloat16", attn_implementation="eager")
    assert not out.exists() and list(out.parent.iterdir()) == []


@needs_export
def test_16bit_sdpa_export_failure_names_the_way_out(tmp_path):
    """PyTorch's legacy exporter (torch 2.13) fails on some 16-bit SDPA models — Llama and Qwen3 in bfloat16, GPT-J
    in both ("ScalarType ComplexDouble is an unexpected tensor scalar type"), or exports GPT-J's float16 SDPA graph
    with mixed dtypes — and the error says what exports them. When torch fixes it this fails, and the 16-bit tests
    can export with sdpa."""
    out = tmp_path / "llama_bf16.onnx"
    with pytest.raises(hf.ExportError, match=r"ComplexDouble.*--attn-implementation eager exports the same"):
        hf.export_hf("llama", out, exporter="legacy", dtype="bfloat16")
    assert not out.exists() and list(tmp_path.iterdir()) == []


@needs_export
def test_cli_export_float16(tmp_path, capsys):
    from pagedkv.cli import main

    out = tmp_path / "qwen2_fp16.onnx"
    assert main(["export", "--family", "qwen2", "-o", str(out), "--exporter", "legacy", "--dtype", "float16"]) == 0
    text = capsys.readouterr().out
    assert out.is_file() and "float16" in text and "verified vs eager float32" in text
