"""Hugging Face export (tiny configs, random weights, offline) -> rewrite -> compare: every family, both PyTorch
exporters (legacy opset 17, dynamo opset 20 and 23), both of transformers' attention implementations (sdpa, the
default, and eager).

Each cell: ``export_hf`` (which itself checks ONNX Runtime against eager PyTorch on four shapes other than the
traced one), then ``conftest.rewrite_and_compare``: a ragged batch (5, 17, 33 tokens) in 8-token prefill chunks (so
steps mix prefill chunks and decodes) and 8 greedy decode steps: logits within the fp16-cache tolerance on the
logits' scale, identical greedy tokens, paged K/V equal to the present K/V.

Also: the legacy export run through ONNX Runtime's transformer optimizer before the rewrite. Cells whose graph the
rewrite does not recognize go into REWRITE_GAPS: strict xfails that must raise RewriteError, so a cell that starts
to pass (or fails differently) turns red until the entry is removed. Skipped as a whole only when torch /
transformers are not installed (the ``export`` extra). The other exporters' matrix is tests/test_exporters.py.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from conftest import rewrite_and_compare

from pagedkv.onnx_export import hf
from pagedkv.onnx_export._hf_families import FAMILIES

NO_EXPORT = hf.why_export_unavailable()
needs_export = pytest.mark.skipif(NO_EXPORT is not None, reason=f"export extra missing: {NO_EXPORT}")

# (exporter, opset): the matrix's exporters. The dynamo exporter at opset 23 writes SDPA as the standard Attention
# op (fed by the Concat'ed, repeated caches) and RoPE as RotaryEmbedding; below 23 it decomposes SDPA.
EXPORTS = (("legacy", 17), ("dynamo", 20), ("dynamo", 23))
ATTENTION_PATTERN = {("dynamo", 23, "sdpa"): "onnx_attention"}  # else "decomposed"

# (family, exporter, opset, attention) -> what the rewrite reports today. Empty: every cell passes. Example:
#   ("qwen3", "dynamo", 20, "sdpa"): "past_value still read outside attention by a Shape node",
REWRITE_GAPS: dict[tuple, str] = {}

_exported: dict = {}


def _rewrite_error():
    from pagedkv.builder.rewrite import RewriteError

    return RewriteError


def _export(family, exporter, tmp_path_factory, opset=None, attention=hf.DEFAULT_ATTENTION):
    key = (family, exporter, opset or hf.DEFAULT_OPSET[exporter], attention)
    if key not in _exported:
        path = tmp_path_factory.mktemp("hf") / f"{family}_{exporter}{key[2]}_{attention}.onnx"
        _exported[key] = hf.export_hf(family, path, exporter=exporter, opset=key[2], attn_implementation=attention,
                                      seed=0)
    return _exported[key]


def _cells():
    for exporter, opset in EXPORTS:
        for attention in hf.ATTENTION_IMPLEMENTATIONS:
            for family in FAMILIES:
                marks = [needs_export]
                gap = REWRITE_GAPS.get((family, exporter, opset, attention))
                if gap:
                    marks.append(pytest.mark.xfail(strict=True, raises=_rewrite_error(), reason=f"rewrite gap: {gap}"))
                yield pytest.param(family, exporter, opset, attention, marks=marks,
                                   id=f"{family}-{exporter}{opset}-{attention}")


@pytest.mark.parametrize("family,exporter,opset,attention", list(_cells()))
def test_export_rewrite_compare(family, exporter, opset, attention, tmp_path_factory):
    result = _export(family, exporter, tmp_path_factory, opset, attention)
    assert result.verify_max_abs_err is not None and result.verify_max_abs_err <= hf.VERIFY_ATOL
    if (exporter, opset, attention) == ("dynamo", 23, "sdpa"):  # the standard ops, past concatenated outside
        graph = onnx.load(str(result.path), load_external_data=False).graph
        attention_ops = [n for n in graph.node if n.op_type == "Attention"]
        assert len(attention_ops) == result.num_layers
        assert all(len([i for i in n.input if i]) == 4 for n in attention_ops)  # q, k, v, mask
    rewritten = rewrite_and_compare(result.path, f"{family}/{exporter} opset {opset}/{attention}")
    want = ATTENTION_PATTERN.get((exporter, opset, attention), "decomposed")
    assert [r.pattern for r in rewritten.report.layers] == [want] * result.num_layers
    assert not {n.op_type for n in rewritten.model.graph.node} & {"Attention", "RotaryEmbedding", "Softmax"}
    window = 8 if family == "mistral" else 0
    assert {r.window for r in rewritten.report.layers} == {window}


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
def test_cli_export(tmp_path, capsys):
    from pagedkv.cli import main

    out = tmp_path / "phi.onnx"
    assert main(["export", "--family", "phi", "-o", str(out), "--exporter", "legacy"]) == 0
    assert out.is_file() and "verified vs eager" in capsys.readouterr().out
