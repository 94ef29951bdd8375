"""onnxruntime's ``com.microsoft::GroupQueryAttention`` (what ORT's transformer optimizer and ONNX Runtime GenAI's
model builder emit)::

    GroupQueryAttention(query [B, S, H*D], key [B, S, KVH*D], value, past_key, past_value, seqlens_k,
                        total_sequence_length, cos_cache, sin_cache) -> output [B, S, H*D] -> o_proj

    GroupQueryAttention(packed [B, S, (H + 2 KVH) * D], "", "", past_key, ...)      packed QKV: the query input
                                                                                   holds q | k | v heads

With ``do_rotary=1`` the op applies RoPE itself from the position-indexed ``cos_cache`` / ``sin_cache``
([max_positions, R/2]); otherwise q and k arrive rotated (e.g. by ``com.microsoft::RotaryEmbedding``).
``local_window_size`` is the window in our convention (see ``onnx_export.synthetic.gqa_local_window_size``,
whose test measures it against the decomposed form).
"""

from __future__ import annotations

import math

from pagedkv.builder.graph_view import GraphView, RewriteError, describe
from pagedkv.builder.patterns import AttentionMatch, KVAnchor, anchor_nodes, heads_from_shape
from pagedkv.config import RopeStyle

NAME = "contrib_gqa"
QUERY, KEY, VALUE, PAST_K, PAST_V, SEQLENS_K, TOTAL_LEN, COS, SIN = range(9)
OUTPUT, PRESENT_K, PRESENT_V = range(3)
ANCHOR_OPS = {("com.microsoft", "GroupQueryAttention"): {PAST_K: PRESENT_K, PAST_V: PRESENT_V}}
UNSUPPORTED_INPUTS = {10: "attention_bias", 11: "head_sink", 12: "k_scale", 13: "v_scale", 14: "q_norm_weight",
                      15: "k_norm_weight", 16: "query_seqlens"}


def match(view: GraphView, anchors: list[KVAnchor]) -> list[AttentionMatch]:
    matches = []
    for node in anchor_nodes(anchors):
        inputs = list(node.input) + [""] * (17 - len(node.input))
        packed = not inputs[KEY] and not inputs[VALUE]
        if bool(inputs[KEY]) != bool(inputs[VALUE]):
            raise RewriteError(f"{describe(node)}: expected both key and value inputs, or neither (packed QKV)")
        for index, name in UNSUPPORTED_INPUTS.items():
            if inputs[index]:
                raise RewriteError(f"{describe(node)}: input {name} is not supported")
        for attr in ("smooth_softmax", "qk_output", "k_quant_type", "v_quant_type"):
            value = GraphView.attr(node, attr, 0)
            if value not in (0, b"NONE", "NONE", b"", ""):
                raise RewriteError(f"{describe(node)}: attribute {attr}={value!r} is not supported")
        heads = int(GraphView.attr(node, "num_heads"))
        kv_heads, head_dim = _heads(view, node, inputs, heads, packed)
        if int(GraphView.attr(node, "kv_num_heads")) != kv_heads:
            raise RewriteError(f"{describe(node)}: kv_num_heads={GraphView.attr(node, 'kv_num_heads')} but the past "
                               f"input has {kv_heads} heads")
        tables = None
        if GraphView.attr(node, "do_rotary", 0):
            cos, sin = view.constant(inputs[COS]), view.constant(inputs[SIN])
            if cos is None or sin is None:
                raise RewriteError(f"{describe(node)}: do_rotary=1 needs constant cos_cache/sin_cache inputs")
            style = RopeStyle.GPTJ if GraphView.attr(node, "rotary_interleaved", 0) else RopeStyle.NEOX
            tables = (cos, sin, style)
        local = int(GraphView.attr(node, "local_window_size", -1))
        matches.append(AttentionMatch(
            pattern=NAME, anchor=node, past_key=view.source_input(inputs[PAST_K]), past_value=view.source_input(inputs[PAST_V]),
            present_key=node.output[PRESENT_K], present_value=node.output[PRESENT_V], q_end=inputs[QUERY],
            k_end=inputs[QUERY if packed else KEY], v_end=inputs[QUERY if packed else VALUE], num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, packed_qkv=packed,
            out=node.output[OUTPUT],
            scale=float(GraphView.attr(node, "scale", 0.0) or 1.0 / math.sqrt(head_dim)),
            logit_softcap=float(GraphView.attr(node, "softcap", 0.0)), window=max(local, 0),
            rope_tables=tables))
    return matches


def _heads(view: GraphView, node, inputs: list[str], heads: int, packed: bool) -> tuple[int, int]:
    """(kv_heads, head_dim): off the past input; the model builder leaves its head dim symbolic
    (``kv_cache_dim``), so then head_dim = the query width / (heads of the query input)."""
    shape = view.static_shape(inputs[PAST_K])
    if shape and len(shape) == 4 and shape[1] is not None and shape[3] is None:
        kv_heads = int(shape[1])
        width = (view.static_shape(inputs[QUERY]) or [None])[-1]
        columns = heads + 2 * kv_heads if packed else heads
        if width is None or width % columns:
            raise RewriteError(f"{describe(node)}: the past input {inputs[PAST_K]!r} has a symbolic head dim and "
                               f"the query width ({width}) is not a multiple of its {columns} heads")
        return kv_heads, width // columns
    return heads_from_shape(view, inputs[PAST_K], node)
