"""The attention rewrite on every synthetic structure: the report equals the generator's config, the graph
is valid and follows the contract (docs/builder.md), everything outside attention is bit-identical, and each
rewritten layer computes the original layer's attention (``pagedkv.reference`` write + paged attention over
a paged fp16 pool, chunked prefill and mixed batches) — plus the precise errors on graphs that don't match."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import TOLERANCES

from pagedkv.builder.graph_view import GraphView, ProbeStep
from pagedkv.builder.rewrite import (RewriteError, RewriteOptions, add_rewrite_arguments, options_from_args,
                                     rewrite_model)
from pagedkv.config import (ATTENTION_PLUGIN_NAME, FLOATS, ONNX_DOMAIN, WRITE_PLUGIN_NAME, AttentionConfig, RopeConfig,
                            RopeScaling, RopeStyle, WriteConfig, attribute_types)
from pagedkv.layout import CacheDType
from pagedkv.onnx_export.synthetic import SyntheticConfig, make_synthetic_model, structure_matrix
from pagedkv.reference.attention import paged_attention
from pagedkv.reference.rope import attention_factor
from pagedkv.reference.write import qkv_write
from pagedkv.runtime.graph import RewrittenGraph
from pagedkv.step import StepMetadata

CASES = structure_matrix()
PATTERN_OF_FORM = {"decomposed": "decomposed", "contrib_rotary": "decomposed", "contrib_gqa": "contrib_gqa",
                   "onnx23": "onnx_attention"}
ATTENTION_SCOPES = ("/attn/", "/mask/", "/rotary/")  # synthetic node scopes the rewrite may remove
_CACHE: dict = {}


def original(cfg: SyntheticConfig) -> onnx.ModelProto:
    if ("model", cfg) not in _CACHE:
        _CACHE[("model", cfg)] = make_synthetic_model(cfg)
    return _CACHE[("model", cfg)]


def rewritten(cfg: SyntheticConfig, **options):
    key = ("rewrite", cfg, tuple(sorted(options.items())))
    if key not in _CACHE:
        _CACHE[key] = rewrite_model(original(cfg), RewriteOptions(**options))
    return _CACHE[key]


def plugin_nodes(model: onnx.ModelProto, op: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op and n.domain == ONNX_DOMAIN]


def attributes(node: onnx.NodeProto) -> dict:
    """A node's attributes, STRING values decoded."""
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


# ---- what the rewrite found ------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", CASES, ids=lambda c: c.id)
def test_report_matches_the_generator_config(cfg):
    result = rewritten(cfg)
    assert len(result.report.layers) == cfg.num_layers
    for i, layer in enumerate(result.report.layers):
        assert layer.index == i
        assert layer.pattern == PATTERN_OF_FORM[cfg.attention_form]
        assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        rotary_dim = 0 if cfg.rotary_dim == cfg.head_dim else cfg.rotary_dim
        if cfg.rope.scaling == RopeScaling.YARN:  # every YaRN field read back (attention factor: the default)
            assert layer.rope == dataclasses.replace(cfg.rope, rotary_dim=rotary_dim)
        elif cfg.rope.scaling == RopeScaling.LONGROPE:  # both tables and the switch; factors as float32 carries them
            assert (layer.rope.style, layer.rope.rotary_dim, layer.rope.theta, layer.rope.original_max_positions) == \
                (cfg.rope.style, rotary_dim, cfg.rope.theta, cfg.rope.original_max_positions)
            for name in ("short_factors", "long_factors"):
                np.testing.assert_allclose(getattr(layer.rope, name), getattr(cfg.rope, name), rtol=1e-6)
            assert attention_factor(layer.rope) == pytest.approx(attention_factor(cfg.rope), rel=1e-6)
        else:
            want_rope = RopeConfig(style=cfg.rope.style, rotary_dim=rotary_dim, theta=cfg.rope.theta,
                                   scaling=cfg.rope.scaling, factor=cfg.rope.factor if cfg.rope.scaling else 1.0)
            assert layer.rope == want_rope
        assert layer.qkv_bias == cfg.qkv_bias
        assert layer.fused_qkv == cfg.fused_qkv
        assert layer.qk_norm == cfg.qk_norm
        assert layer.window == cfg.sliding_window and layer.attention_sinks == 0
        assert layer.softmax_scale == pytest.approx(cfg.resolved_softmax_scale, rel=1e-6)
        assert layer.logit_softcap == pytest.approx(cfg.logit_softcap, rel=1e-7)
        assert layer.projection == ("kept" if cfg.qk_norm else "packed")
    assert not result.report.explicit_positions
    text = str(result.report)
    assert f"rewrote {cfg.num_layers} attention layer(s)" in text and f"head_dim={cfg.head_dim}" in text


# ---- the rewritten graph ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", CASES, ids=lambda c: c.id)
def test_graph_is_valid_and_follows_the_contract(cfg):
    result = rewritten(cfg)
    model = result.model
    onnx.checker.check_model(model)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v.type.tensor_type for v in (*inferred.graph.value_info, *inferred.graph.input,
                                                   *inferred.graph.output)}
    assert {(o.domain, o.version) for o in model.opset_import} >= {(ONNX_DOMAIN, 1)}
    inputs = {i.name: i for i in model.graph.input}
    assert list(inputs) == ["input_ids", "kv_pools", "cu_q_lens", "past_lens", "block_table_0", "logits_rows",
                            "sampling_params", "penalty_tokens", "penalty_counts"]
    elem = {n: i.type.tensor_type.elem_type for n, i in inputs.items()}
    assert elem == {"input_ids": onnx.TensorProto.INT64, "kv_pools": onnx.TensorProto.INT64,
                    "cu_q_lens": onnx.TensorProto.INT32, "past_lens": onnx.TensorProto.INT32,
                    "block_table_0": onnx.TensorProto.INT32, "logits_rows": onnx.TensorProto.INT32,
                    "sampling_params": onnx.TensorProto.FLOAT, "penalty_tokens": onnx.TensorProto.INT32,
                    "penalty_counts": onnx.TensorProto.FLOAT}
    assert [d.dim_value or d.dim_param for d in inputs["input_ids"].type.tensor_type.shape.dim] == [1, "num_tokens"]
    assert [d.dim_value for d in inputs["kv_pools"].type.tensor_type.shape.dim] == [1, 4]
    assert [o.name for o in model.graph.output] == ["logits", "next_tokens", "next_logprobs", "top_tokens",
                                                     "top_logprobs"] + [f"kv_write_status_{i}" for i in range(cfg.num_layers)]
    writes, attns = plugin_nodes(model, WRITE_PLUGIN_NAME), plugin_nodes(model, ATTENTION_PLUGIN_NAME)
    assert len(writes) == len(attns) == cfg.num_layers
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    for i, (write, attn) in enumerate(zip(writes, attns)):
        report = result.report.layers[i]
        assert attributes(write) == report.write.to_node_attributes()
        assert attributes(attn) == report.attention.to_node_attributes()
        for node, cls in ((write, WriteConfig), (attn, AttentionConfig)):
            # the ONNX type of each attribute is its field's declared one (FLOAT for float fields, whatever
            # the value): TensorRT's parser turns it into the field type the creator expects
            attr_types = {a.name: a.type for a in node.attribute}
            # (a FLOATS attribute only when its list is not empty)
            assert attr_types == {**{n: getattr(onnx.AttributeProto, t) for n, t in attribute_types(cls).items()
                                     if t != FLOATS or n in attr_types},
                             "plugin_namespace": onnx.AttributeProto.STRING,
                             "plugin_version": onnx.AttributeProto.STRING}
        assert WriteConfig.from_attributes(attributes(write)) == report.write
        assert AttentionConfig.from_attributes(attributes(attn)) == report.attention
        assert report.write.pool.layer_index == i and report.write.pool.num_layers == cfg.num_layers
        assert list(write.input[1:5]) == ["kv_pools", "block_table_0", "cu_q_lens", "past_lens"]
        assert len(write.input) == 5 + int(report.write.has_bias)
        assert list(attn.input) == [write.output[0], "kv_pools", "block_table_0", "cu_q_lens", "past_lens",
                                    write.output[1]]
        assert write.output[1] == f"kv_write_status_{i}"
        assert [d.dim_value or d.dim_param for d in types[write.input[0]].shape.dim] == ["num_tokens", width]
        assert types[attn.output[0]].elem_type == onnx.TensorProto.FLOAT
        assert [d.dim_value or d.dim_param for d in types[attn.output[0]].shape.dim] == [
            "num_tokens", cfg.num_heads * cfg.head_dim]
    assert [list(g.layers) for g in result.pool_groups] == [list(range(cfg.num_layers))]
    # the groups the rewrite made are the groups the runtime reads back (group 0: block_table_0, kv_pools row 0)
    assert RewrittenGraph.load(model).groups == tuple(result.pool_groups)


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: c.id)
def test_everything_outside_attention_is_bit_identical(cfg):
    before, after = original(cfg), rewritten(cfg).model
    # the LM head reads its rows through the logits head's Gather (logits_rows): undo that one edge
    rows = next(n for n in after.graph.node if n.name.startswith("/pagedkv/logits_head/rows/Gather"))
    kept = set()
    for n in after.graph.node:
        n = copy.deepcopy(n)
        n.input[:] = [rows.input[0] if i == rows.output[0] else i for i in n.input]
        kept.add(n.SerializeToString())
    outside = [n for n in before.graph.node if not any(s in n.name for s in ATTENTION_SCOPES)]
    missing = [n.name for n in outside if n.SerializeToString() not in kept]
    assert not missing, f"nodes outside attention changed or vanished: {missing[:5]}"
    old_inits = {t.name: t.SerializeToString() for t in before.graph.initializer}
    for t in after.graph.initializer:
        if t.name in old_inits:
            assert t.SerializeToString() == old_inits[t.name], t.name
    used = {i for n in outside for i in n.input}
    assert used & set(old_inits) <= {t.name for t in after.graph.initializer}
    assert not [n.name for n in after.graph.node if "/attn/" in n.name and "/mask/" in n.name]
    assert not any(n.op_type in ("Softmax", "Attention", "GroupQueryAttention", "RotaryEmbedding")
                   for n in after.graph.node)


# ---- numerics: each rewritten layer against the original layer --------------------------------------
def _attention_io(before: onnx.ModelProto, after: onnx.ModelProto):
    """Per layer: (rewritten qkv tensor, bias or None, write node, attention node, reshaped output tensor,
    original attention output tensor)."""
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in after.graph.initializer}
    by_name = {n.name: n for n in before.graph.node}
    out = []
    for write, attn in zip(plugin_nodes(after, WRITE_PLUGIN_NAME), plugin_nodes(after, ATTENTION_PLUGIN_NAME)):
        cfg = WriteConfig.from_attributes(attributes(write))
        bias = inits[write.input[-1]] if cfg.has_bias else None
        reshape = next(n for n in after.graph.node if attn.output[0] in n.input)
        o_proj = next(n for n in after.graph.node if reshape.output[0] in n.input)
        index = list(o_proj.input).index(reshape.output[0])
        out.append((write.input[0], bias, write, attn, reshape.output[0], by_name[o_proj.name].input[index]))
    return out


def _run_original(model: onnx.ModelProto, ids: np.ndarray, cfg: SyntheticConfig, extra: list[str]):
    m = copy.deepcopy(model)
    m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in extra)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    S = ids.shape[0]
    feeds = {"input_ids": ids[None].astype(np.int64), "attention_mask": np.ones((1, S), np.int64),
             "position_ids": np.arange(S, dtype=np.int64)[None]}
    for i in range(cfg.num_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, cfg.num_kv_heads, 0, cfg.head_dim), np.float32)
    outs = sess.run(extra, feeds)
    return [o.reshape(S, -1) for o in outs]


def _qkv_rows(after, io, layer: int, ids: np.ndarray, original_attn: list[np.ndarray]) -> np.ndarray:
    """The rewritten graph's packed qkv of ``layer`` for a sequence, earlier layers' attention outputs fed
    with the original's (so only this layer's rewrite is under test)."""
    view = GraphView(after)
    feeds = {"input_ids": ids[None].astype(np.int64)}
    for j in range(layer):
        feeds[io[j][4]] = original_attn[j][None].astype(np.float32)
    step = ProbeStep({"input_ids": "input_ids"}, {}, batch=1, past=0, seq=ids.shape[0])
    (qkv,) = view.evaluate([io[layer][0]], feeds, step)
    return np.asarray(qkv, dtype=np.float64)


# Steps of two sequences (A, B): (tokens of A, tokens of B). Chunked prefill, a mixed prefill + decode step,
# and decodes; page size 4 so every step crosses pages.
SCHEDULE = [(6, 3), (1, 5), (1, 1), (4, 0), (1, 2)]
PAGE_SIZE = 4


# The original runs each prompt in one pass here; LongRoPE's table follows each step's length, so its chunked
# schedule differs from that pass by design. Its layers are compared step by step (the original with dense past)
# by `pagedkv compare` on the phi3 family (tests/test_export_hf.py) and on the synthetic graph below.
@pytest.mark.parametrize("cfg", [c for c in CASES if c.rope.scaling != RopeScaling.LONGROPE], ids=lambda c: c.id)
def test_rewritten_layers_compute_the_original_attention(cfg):
    before = original(cfg)
    after = rewritten(cfg, page_size=PAGE_SIZE, cache_dtype="fp16").model
    io = _attention_io(before, after)
    rng = np.random.default_rng(11)
    lengths = [sum(s[k] for s in SCHEDULE) for k in (0, 1)]
    prompts = [rng.integers(0, cfg.vocab, n) for n in lengths]
    original_attn = [_run_original(before, ids, cfg, [t[5] for t in io]) for ids in prompts]  # [seq][layer]
    layout_pool = WriteConfig.from_attributes(attributes(io[0][2])).pool
    pages = -(-max(lengths) // PAGE_SIZE)
    num_blocks = 2 * pages + 3
    block_ids = rng.permutation(num_blocks)[:2 * pages].reshape(2, pages).astype(np.int32)  # scattered pages
    pool = np.full(layout_pool.layout().pool_shape(num_blocks), np.nan, dtype=CacheDType.FP16.numpy_dtype)
    atol, rtol = TOLERANCES["float16"]  # K/V are stored as fp16
    for layer, (_, bias, write, attn, _, _) in enumerate(io):
        wcfg, acfg = WriteConfig.from_attributes(attributes(write)), AttentionConfig.from_attributes(attributes(attn))
        qkv = [_qkv_rows(after, io, layer, ids, [original_attn[k][j] for j in range(layer)])
               for k, ids in enumerate(prompts)]
        done = [0, 0]
        for step in SCHEDULE:
            rows = [qkv[k][done[k]:done[k] + step[k]] for k in (0, 1)]
            meta = StepMetadata(block_table=block_ids, cu_q_lens=np.cumsum([0, *step]), past_lens=np.asarray(done))
            q = qkv_write(np.concatenate(rows), bias, meta, pool, wcfg)
            out = paged_attention(q, meta, pool, acfg).reshape(meta.num_tokens, -1)
            want = np.concatenate([original_attn[k][layer][done[k]:done[k] + step[k]] for k in (0, 1)])
            np.testing.assert_allclose(out, want, atol=atol, rtol=rtol,
                                       err_msg=f"layer {layer}, step {step} after {done}")
            done = [done[k] + step[k] for k in (0, 1)]
    _check_only_live_slots_written(pool, layout_pool.layout(), block_ids, lengths, cfg.num_layers)


def _check_only_live_slots_written(pool, layout, block_ids, lengths, num_layers):
    """Blocks outside the block tables stay NaN; every live (layer, K/V, head, position) slot was written."""
    values = pool.astype(np.float32)
    unused = sorted(set(range(pool.shape[0])) - set(block_ids.ravel().tolist()))
    assert np.isnan(values[unused]).all()
    flat, dims = values.reshape(-1), np.arange(layout.head_dim)
    for k, length in enumerate(lengths):
        block, offset, _ = layout.locate(block_ids[k], np.arange(length), pool.shape[0])
        for layer in range(num_layers):
            for kv in (0, 1):
                for head in range(layout.num_kv_heads):
                    at = layout.elem_offset(block, layer, kv, head, offset)[:, None] + dims
                    assert not np.isnan(flat[at]).any(), (k, layer, kv, head)


# ---- options ---------------------------------------------------------------------------------------------
def test_options_shape_the_plugins():
    cfg = SyntheticConfig(sliding_window=5)
    result = rewrite_model(original(cfg), RewriteOptions(page_size=32, cache_dtype="fp8", k_scale=0.5, v_scale=0.25,
                                                         window=0, max_blocks=64, pool_grouping="per_layer",
                                                         explicit_positions=True))
    model = result.model
    assert [list(g.layers) for g in result.pool_groups] == [[0], [1]]
    inputs = {i.name: i for i in model.graph.input}
    assert "position_ids" in inputs and inputs["position_ids"].type.tensor_type.elem_type == onnx.TensorProto.INT32
    assert [d.dim_value for d in inputs["kv_pools"].type.tensor_type.shape.dim] == [2, 4]
    assert [d.dim_value or d.dim_param for d in inputs["block_table_1"].type.tensor_type.shape.dim] == ["batch", 64]
    for i, (write, attn) in enumerate(zip(plugin_nodes(model, WRITE_PLUGIN_NAME),
                                          plugin_nodes(model, ATTENTION_PLUGIN_NAME))):
        w, a = WriteConfig.from_attributes(attributes(write)), AttentionConfig.from_attributes(attributes(attn))
        assert w.explicit_positions and write.input[5] == "position_ids"
        assert (w.pool.page_size, w.pool.cache_dtype, w.pool.k_scale, w.pool.v_scale) == (32, CacheDType.FP8_E4M3, 0.5, 0.25)
        assert (w.pool.pool_index, w.pool.layer_index, w.pool.num_layers) == (i, 0, 1)
        assert write.input[2] == f"block_table_{i}"
        assert a.window == 0
    assert result.report.explicit_positions


def test_single_pool_group_and_window_override():
    result = rewrite_model(original(SyntheticConfig()), RewriteOptions(pool_grouping="single", window=7))
    assert [list(g.layers) for g in result.pool_groups] == [[0, 1]]
    assert {layer.window for layer in result.report.layers} == {7}


@pytest.mark.parametrize("bad, message", [
    (dict(page_size=0), "page_size"), (dict(cache_dtype="fp4"), "cache_dtype"), (dict(pool_grouping="x"), "pool_grouping"),
    (dict(window=-2), "window"), (dict(max_blocks=0), "max_blocks"), (dict(k_scale=0.0), "k_scale"),
])
def test_option_errors_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        RewriteOptions(**bad)


def test_cli_arguments_map_to_options():
    parser = add_rewrite_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["in.onnx", "-o", "out.onnx", "--page-size", "64", "--cache-dtype", "int8",
                              "--k-scale", "0.1", "--v-scale", "0.2", "--window", "0", "--pool-grouping",
                              "per_layer", "--explicit-positions", "--allow-no-rope", "--dtype", "bf16"])
    assert options_from_args(args) == RewriteOptions(page_size=64, cache_dtype="int8", k_scale=0.1, v_scale=0.2,
                                                     window=0, pool_grouping="per_layer", explicit_positions=True,
                                                     require_rope=False, dtype="bfloat16")
    assert (args.input, args.output) == ("in.onnx", "out.onnx")


def test_input_model_is_not_modified():
    model = original(SyntheticConfig(qk_norm=True))
    before = model.SerializeToString()
    rewrite_model(model)
    assert model.SerializeToString() == before


# ---- graphs that don't match: precise errors, nothing returned --------------------------------------------
def _edited(cfg: SyntheticConfig, edit) -> onnx.ModelProto:
    model = copy.deepcopy(original(cfg))
    edit(model)
    return model


def _node(model, op: str, scope: str = "/model/layers.0/attn/") -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == op and n.name.startswith(scope))


def test_attention_without_rope_is_an_error_unless_allowed():
    model = original(SyntheticConfig(rope=RopeConfig(style=RopeStyle.NONE)))
    with pytest.raises(RewriteError, match=r"MatMul node '/model/layers.0/attn/MatMul_\d+': expected RoPE on q and k"
                                           r".*no position_ids reach the layer's input.*--allow-no-rope"):
        rewrite_model(model)
    result = rewrite_model(model, RewriteOptions(require_rope=False))
    assert {layer.rope.style for layer in result.report.layers} == {RopeStyle.NONE}


def test_softmax_on_the_wrong_axis_names_the_softmax():
    def edit(model):
        softmax = _node(model, "Softmax")
        softmax.attribute[0].i = 2
        edit.name = softmax.name
    model = _edited(SyntheticConfig(), edit)
    with pytest.raises(RewriteError, match=rf"Softmax node '{edit.name}': expected Softmax over the last axis"):
        rewrite_model(model)


def test_concat_on_the_wrong_axis_names_the_concat():
    def edit(model):
        concat = next(n for n in model.graph.node if n.op_type == "Concat" and n.output[0] == "present.0.key")
        concat.attribute[0].i = 1
        edit.name = concat.name
    model = _edited(SyntheticConfig(), edit)
    with pytest.raises(RewriteError, match=rf"Concat node '{edit.name}': expected the past/new Concat along the "
                                           "sequence axis 2, got axis=1"):
        rewrite_model(model)


def test_concat_with_new_tokens_first_names_the_concat():
    def edit(model):
        concat = next(n for n in model.graph.node if n.op_type == "Concat" and n.output[0] == "present.1.value")
        concat.input[0], concat.input[1] = concat.input[1], concat.input[0]
        edit.name = concat.name
    model = _edited(SyntheticConfig(), edit)
    with pytest.raises(RewriteError, match=rf"Concat node '{edit.name}': expected Concat\(past"):
        rewrite_model(model)


def test_q_and_k_with_different_rope_is_an_error():
    """Only k rotated: q reaches attention unrotated."""
    def edit(model):
        scores = next(n for n in model.graph.node if n.op_type == "MatMul" and n.name.startswith("/model/layers.0/attn/")
                      and "Transpose" in n.input[1])
        rope_out = next(n for n in model.graph.node if n.output[0] == scores.input[0])  # q's rope Add
        mul = next(n for n in model.graph.node if n.output[0] == rope_out.input[0])  # x * cos
        scores.input[0] = mul.input[0]
    model = _edited(SyntheticConfig(), edit)
    with pytest.raises(RewriteError, match="expected RoPE on both q and k, q"):
        rewrite_model(model)


def test_mask_with_a_position_bias_is_an_error():
    def edit(model):
        where = _node(model, "Where", "/model/mask/")
        bias = onnx.numpy_helper.from_array(np.asarray(-0.5, dtype=np.float32), "alibi_like_bias")
        model.graph.initializer.append(bias)
        where.input[1] = "alibi_like_bias"
    model = _edited(SyntheticConfig(), edit)
    with pytest.raises(RewriteError, match=r"MatMul node .*: expected the mask to add 0 \(visible\)"):
        rewrite_model(model)


def _insert_after(model, tensor: str, op: str, name: str) -> None:
    """A one-input ``op`` node on ``tensor``, its consumers rewired to its output."""
    out = f"{tensor}/{op}_inserted"
    nodes = list(model.graph.node)
    at = next(k for k, n in enumerate(nodes) if tensor in n.output) + 1
    for node in nodes:
        for k, i in enumerate(node.input):
            if i == tensor:
                node.input[k] = out
    nodes.insert(at, onnx.helper.make_node(op, [tensor], [out], name=name))
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def test_soft_cap_after_the_mask_or_twice_is_an_error():
    def after_mask(model):
        softmax = _node(model, "Softmax")
        _insert_after(model, softmax.input[0], "Tanh", "tanh_after_mask")
    with pytest.raises(RewriteError, match="Tanh node 'tanh_after_mask': expected one soft-cap Tanh on the scores "
                                           "before the mask, found it after the mask"):
        rewrite_model(_edited(SyntheticConfig(), after_mask))

    def twice(model):
        tanh = _node(model, "Tanh")
        _insert_after(model, tanh.output[0], "Tanh", "second_tanh")
    with pytest.raises(RewriteError, match="Tanh node 'second_tanh': .* found a second Tanh"):
        rewrite_model(_edited(SyntheticConfig(logit_softcap=2.0), twice))


def test_rope_table_that_switches_back_is_an_error():
    """A LongRoPE-like switch that applies at one kv length only (Equal instead of Greater): not one switch."""
    cfg = SyntheticConfig(rope=RopeConfig(scaling=RopeScaling.LONGROPE, original_max_positions=5,
                                          short_factors=(1.0,) * 32, long_factors=(3.0,) * 32))

    def edit(model):
        _node(model, "Greater", "/model/rotary/").op_type = "Equal"  # long only when max(position_ids) + 1 == 5
    with pytest.raises(RewriteError, match="the RoPE table changes past kv length 4 and changes back later"):
        rewrite_model(_edited(cfg, edit))


def test_graph_without_past_inputs_is_an_error():
    model = original(SyntheticConfig())
    stripped = onnx.helper.make_model(onnx.helper.make_graph([], "empty", [], []))
    with pytest.raises(RewriteError, match="no past-KV input found"):
        rewrite_model(stripped)
    assert model.graph.node  # the cached original is untouched


def test_unsupported_head_dim_names_the_layer():
    model = original(SyntheticConfig(head_dim=48, hidden=64))
    with pytest.raises(RewriteError, match=r"layer 0 cannot use the plugins: head_dim: expected one of"):
        rewrite_model(model)


def test_default_scale_is_read_not_assumed():
    result = rewritten(SyntheticConfig(softmax_scale=0.3, scale_mode="sqrt_qk"))
    assert result.report.layers[0].softmax_scale == pytest.approx(0.3, rel=1e-6)
    assert result.report.layers[0].softmax_scale != pytest.approx(1 / math.sqrt(64))


def test_exporter_quirks_around_the_cache():
    """Seen in real exports: the past wrapped in a one-input Concat (the legacy exporter's DynamicCache),
    the present produced by a Cast after the past/present Concat (GPT-J), and the batch size read from a
    past input's Shape by nodes that stay (the dynamo exporter)."""
    cfg = SyntheticConfig(qk_norm=True)

    def edit(model):
        nodes = model.graph.node
        concat = next(n for n in nodes if n.op_type == "Concat" and n.output[0] == "present.0.key")
        alias = onnx.helper.make_node("Concat", ["past_key_values.0.key"], ["past0_alias"], axis=2, name="/alias")
        concat.input[0] = "past0_alias"
        concat.output[0] = "k_cat"
        for n in nodes:  # readers of the present now read the Cast's output, like GPT-J's graph
            n.input[:] = ["present.0.key" if i == "k_cat" and n is not concat else i for i in n.input]
        cast = onnx.helper.make_node("Cast", ["k_cat"], ["present.0.key"], to=onnx.TensorProto.FLOAT, name="/cast")
        q_shape = next(n for n in nodes if n.op_type == "Shape" and n.name.startswith("/model/layers.0/attn/"))
        batch = onnx.helper.make_node("Shape", ["past_key_values.1.value"], ["past_batch"], start=0, end=1,
                                      name="/past_batch")
        gather = next(n for n in nodes if q_shape.output[0] in n.input)  # Gather(Shape(q), 0): the batch size,
        gather.input[0], gather.input[1] = "past_batch", "zero_index"  # now read off a past input's shape
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(0, np.int64), "zero_index"))
        index = list(nodes).index(concat)
        nodes.insert(index + 1, cast)
        nodes.insert(0, alias)
        nodes.insert(0, batch)
    model = _edited(cfg, edit)
    onnx.checker.check_model(model)
    result = rewrite_model(model)
    base = rewritten(cfg)
    assert [(r.num_heads, r.num_kv_heads, r.rope, r.window, r.softmax_scale) for r in result.report.layers] == [
        (r.num_heads, r.num_kv_heads, r.rope, r.window, r.softmax_scale) for r in base.report.layers]
    folded = [n for n in result.model.graph.node if n.name == "/past_batch"]
    assert folded and folded[0].op_type == "Constant"  # batch 1 of the packed graph
    assert "past_key_values.1.value" not in {i.name for i in result.model.graph.input}


# ---- the opset-23 Attention op fed by the past/present Concat (the dynamo exporter at opset 23 with sdpa) ----
def _past_outside_attention(model: onnx.ModelProto, repeat: bool) -> None:
    """Move each Attention op's past into Concats before it (present = Concat(past, new)); with ``repeat``, the
    caches also go through transformers' repeat_kv (Unsqueeze -> Expand -> Reshape) like the real export."""
    nodes = model.graph.node
    for attn in [n for n in nodes if n.op_type == "Attention"]:
        at = list(nodes).index(attn)
        layer = attn.name.split("/")[2]
        q, k, v, mask, past_k, past_v = attn.input
        heads = 4
        new = []
        caches = []
        for name, new_t, past, present in (("k", k, past_k, attn.output[1]), ("v", v, past_v, attn.output[2])):
            new.append(onnx.helper.make_node("Concat", [past, new_t], [present], axis=2, name=f"/{layer}/cat_{name}"))
            cache = present
            if repeat:
                shape = f"/{layer}/{name}_shape"
                new += [onnx.helper.make_node("Unsqueeze", [present, "axis2"], [f"{cache}_u"],
                                              name=f"/{layer}/u_{name}"),
                        onnx.helper.make_node("Shape", [f"{cache}_u"], [shape], name=f"/{layer}/s_{name}"),
                        onnx.helper.make_node("Mul", [shape, "repeat_factor"], [f"{shape}_r"],
                                              name=f"/{layer}/m_{name}"),
                        onnx.helper.make_node("Expand", [f"{cache}_u", f"{shape}_r"], [f"{cache}_e"],
                                              name=f"/{layer}/e_{name}"),
                        onnx.helper.make_node("Reshape", [f"{cache}_e", "repeated_shape"], [f"{cache}_r"],
                                              name=f"/{layer}/r_{name}")]
                cache = f"{cache}_r"
            caches.append(cache)
        del attn.input[:]
        attn.input.extend([q, caches[0], caches[1], mask])
        del attn.output[1:]
        for i, node in enumerate(new):
            nodes.insert(at + i, node)
    if repeat:
        model.graph.initializer.extend([
            onnx.numpy_helper.from_array(np.asarray([2], np.int64), "axis2"),
            onnx.numpy_helper.from_array(np.asarray([1, 1, heads // 2, 1, 1], np.int64), "repeat_factor"),
            onnx.numpy_helper.from_array(np.asarray([0, heads, -1, 64], np.int64), "repeated_shape")])


def _run_step(model: onnx.ModelProto, cfg: SyntheticConfig, past: int, seq: int) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    feeds = {"input_ids": rng.integers(0, cfg.vocab, (1, seq)).astype(np.int64),
             "attention_mask": np.ones((1, past + seq), np.int64),
             "position_ids": np.arange(past, past + seq, dtype=np.int64)[None]}
    for i in range(cfg.num_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((1, cfg.num_kv_heads, past, cfg.head_dim),
                                                                     dtype=np.float32)
    return sess.run(None, feeds)[0]


@pytest.mark.parametrize("repeat", [False, True], ids=["gqa-in-op", "repeat_kv"])
def test_onnx_attention_fed_by_the_present_concat(repeat):
    cfg = SyntheticConfig(attention_form="onnx23")  # 4 query heads, 2 KV heads
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 64)
    model = _edited(cfg, lambda m: _past_outside_attention(m, repeat))
    onnx.checker.check_model(model)
    np.testing.assert_allclose(_run_step(model, cfg, 5, 3), _run_step(original(cfg), cfg, 5, 3), rtol=1e-5, atol=1e-5)
    result = rewrite_model(model)
    base = rewritten(cfg)
    fields = ("pattern", "num_heads", "num_kv_heads", "head_dim", "rope", "window", "softmax_scale", "qkv_bias")
    assert [[getattr(r, f) for f in fields] for r in result.report.layers] == [
        [getattr(r, f) for f in fields] for r in base.report.layers]
    for op in (WRITE_PLUGIN_NAME, ATTENTION_PLUGIN_NAME):
        assert [attributes(n) for n in plugin_nodes(result.model, op)] == [
            attributes(n) for n in plugin_nodes(base.model, op)]
    assert not {"Attention", "RotaryEmbedding", "Expand"} & {n.op_type for n in result.model.graph.node}


def test_onnx_attention_with_a_wrong_repeat_names_the_op():
    cfg = SyntheticConfig(attention_form="onnx23")

    def edit(model):
        _past_outside_attention(model, repeat=True)
        for n in model.graph.node:  # new axis before the KV heads, tiled: query head h reads KV head h % 2
            if n.op_type == "Expand":
                n.op_type, n.input[1] = "Tile", "tile_repeats"
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray([1, 2, 1, 1, 1], np.int64),
                                                                    "tile_repeats"))
        for init in model.graph.initializer:
            if init.name == "axis2":
                init.CopyFrom(onnx.numpy_helper.from_array(np.asarray([1], np.int64), "axis2"))
    model = _edited(cfg, edit)
    with pytest.raises(RewriteError, match=r"Attention node '/model/layers.0/attn/Attention_\d+': expected the cache "
                                           r"'present.0.key' to reach .* \(query head h reading KV head h // 2\), "
                                           r"got shape \[1, 4, 5, 64\], heads \[0.0, 1.0, 0.0, 1.0\]"):
        rewrite_model(model)


# ---- graph reading around ORT's optimizer --------------------------------------------------------------------
def test_partial_value_reads_shape_slices_and_permuted_shapes():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "seq", 4, 8])
    nodes = [onnx.helper.make_node("Shape", ["x"], ["tail"], start=2),
             onnx.helper.make_node("Shape", ["x"], ["full"]),
             onnx.helper.make_node("Gather", ["full", "perm"], ["permuted"]),
             onnx.helper.make_node("Gather", ["permuted", "last"], ["width"]),
             onnx.helper.make_node("Gather", ["table", "last"], ["row"])]
    inits = [onnx.numpy_helper.from_array(np.asarray([0, 2, 1, 3], np.int64), "perm"),
             onnx.numpy_helper.from_array(np.asarray([3], np.int64), "last"),
             onnx.numpy_helper.from_array(np.arange(8, dtype=np.int64).reshape(4, 2), "table")]
    outs = [onnx.helper.make_empty_tensor_value_info(n) for n in ("tail", "width", "row")]
    view = GraphView(onnx.helper.make_model(onnx.helper.make_graph(nodes, "g", [x], outs, inits)))
    assert view.partial_value("tail") == [4, 8]
    assert view.partial_value("permuted") == [None, 4, None, 8]
    assert view.partial_value("width") == [8]
    assert view.partial_value("row") is None  # a row of a 2-D table is not a shape entry


def test_shapes_are_inferred_through_ort_fused_norms():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "seq", 16])
    nodes = [onnx.helper.make_node("SkipSimplifiedLayerNormalization", ["x", "x", "w"], ["y", "", "", "sum"],
                                   domain="com.microsoft", epsilon=1e-6),
             onnx.helper.make_node("SimplifiedLayerNormalization", ["sum", "w"], ["z"], epsilon=1e-6),
             onnx.helper.make_node("Reshape", ["z", "split"], ["heads"])]
    inits = [onnx.numpy_helper.from_array(np.ones(16, np.float32), "w"),
             onnx.numpy_helper.from_array(np.asarray([0, 0, 2, 8], np.int64), "split")]
    model = onnx.helper.make_model(onnx.helper.make_graph(nodes, "g", [x], [
        onnx.helper.make_empty_tensor_value_info("y"), onnx.helper.make_empty_tensor_value_info("heads")], inits),
        opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)])
    view = GraphView(model)
    assert view.static_shape("heads") == [None, None, 2, 8]
    assert view.dim_names("y") == ["batch", "seq", 16]
    assert [n.op_type for n in view.nodes] == ["SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
                                               "Reshape"]  # the view's nodes are the model's own
