"""ONNX's own ``Attention`` op (opset 23), in the two ways exporters feed it the cache.

With the past as the op's own inputs (the synthetic ``onnx23`` form)::

    Attention(Q [B, H, S, D], K [B, KVH, S, D], V, attn_mask, past_key, past_value)
        -> Y [B, H, S, D] -> Transpose -> Reshape -> o_proj,  present_key, present_value

With the past concatenated outside the op (the dynamo exporter at opset 23 with SDPA: transformers'
``repeat_kv`` and the cache update stay in the graph, only ``scaled_dot_product_attention`` becomes the op)::

    past_k ─ Concat(axis 2) ─> present.k ─ [GQA repeat, layout ops] ─ Attention(Q, K, V, mask) -> Y
    k ──────┘

The second form is anchored by the Concat, so ``patterns.decomposed`` follows the cache to the op and hands
over to ``match_concat`` here. The op repeats K/V heads itself when they arrive with fewer heads (query head
h reads KV head h // (H / KVH)), takes ``scale`` and ``softcap`` as attributes and the mask as a bool
(True: attend) or additive float input, or ``is_causal=1`` without a mask.
"""

from __future__ import annotations

import math

import onnx

from pagedkv.builder.graph_view import GraphView, RewriteError, describe
from pagedkv.builder.projection import follow_output
from pagedkv.builder.patterns import AttentionMatch, CachePath, KVAnchor, anchor_nodes, heads_from_shape

NAME = "onnx_attention"
Q, K, V, MASK, PAST_K, PAST_V = range(6)
Y, PRESENT_K, PRESENT_V, QK_MATMUL_OUTPUT = range(4)
ANCHOR_OPS = {("", "Attention"): {PAST_K: PRESENT_K, PAST_V: PRESENT_V}}


def _inputs(node: onnx.NodeProto) -> list[str]:
    return list(node.input) + [""] * (6 - len(node.input))


def _check_outputs(node: onnx.NodeProto) -> None:
    if GraphView.attr(node, "qk_matmul_output_mode", 0) or (len(node.output) > QK_MATMUL_OUTPUT and node.output[QK_MATMUL_OUTPUT]):
        raise RewriteError(f"{describe(node)}: the qk_matmul output is not supported")


def _common(view: GraphView, node: onnx.NodeProto, head_dim: int, scale_outside: float) -> dict:
    """What the op's attributes and Q/mask inputs say: heads, mask or window, scale, softcap, the o_proj input."""
    inputs = _inputs(node)
    q_shape = view.static_shape(inputs[Q])
    if q_shape and len(q_shape) == 4 and q_shape[1]:
        heads, labels = int(q_shape[1]), ["B", "F", "S", "F"]
    elif GraphView.attr(node, "q_num_heads"):
        heads, labels = int(GraphView.attr(node, "q_num_heads")), ["B", "S", "F"]
    else:
        raise RewriteError(f"{describe(node)}: cannot read the number of query heads (Q shape {q_shape})")
    mask = inputs[MASK] or None
    causal = GraphView.attr(node, "is_causal", 0)
    if mask is None and not causal:
        raise RewriteError(f"{describe(node)}: expected an attn_mask input or is_causal=1")
    if mask is not None and causal:
        raise RewriteError(f"{describe(node)}: both is_causal=1 and attn_mask: not supported")
    scale = GraphView.attr(node, "scale", None) or 1.0 / math.sqrt(head_dim)
    out, guards = follow_output(view, node.output[Y], labels, heads, head_dim, node)
    return dict(num_heads=heads, out=out, guards=guards,
                scale=float(scale) * scale_outside, logit_softcap=float(GraphView.attr(node, "softcap", 0.0)),
                mask=mask, window=0 if mask is None else None)


def match(view: GraphView, anchors: list[KVAnchor]) -> list[AttentionMatch]:
    matches = []
    for node in anchor_nodes(anchors):
        inputs = _inputs(node)
        if not inputs[PAST_K] or not inputs[PAST_V] or len(node.output) <= PRESENT_V:
            raise RewriteError(f"{describe(node)}: expected past_key, past_value inputs and present outputs")
        _check_outputs(node)
        kv_heads, head_dim = heads_from_shape(view, inputs[PAST_K], node)
        matches.append(AttentionMatch(
            pattern=NAME, anchor=node, past_key=view.source_input(inputs[PAST_K]),
            past_value=view.source_input(inputs[PAST_V]), present_key=node.output[PRESENT_K],
            present_value=node.output[PRESENT_V], q_end=inputs[Q], k_end=inputs[K], v_end=inputs[V],
            num_kv_heads=kv_heads, head_dim=head_dim, **_common(view, node, head_dim, 1.0)))
    return matches


def match_concat(view: GraphView, node: onnx.NodeProto, key: tuple, value: tuple) -> AttentionMatch:
    """The op fed by the present caches (after an optional GQA repeat) instead of its past inputs.

    ``key`` / ``value``: (anchor, new k|v tensor, the tensor entering the op, scale on the way) as
    ``patterns.decomposed`` followed them from the Concat to this op."""
    inputs = _inputs(node)
    (k_anchor, k_new, k_end, k_scale), (v_anchor, v_new, v_end, v_scale) = key, value
    if inputs[PAST_K] or inputs[PAST_V] or any(o for o in node.output[PRESENT_K:PRESENT_V + 1]):
        raise RewriteError(f"{describe(node)}: the cache is concatenated outside the op, so expected no "
                           f"past_key/past_value inputs and no present outputs, got inputs {list(node.input)}")
    _check_outputs(node)
    if inputs[K] != k_end or inputs[V] != v_end:
        raise RewriteError(f"{describe(node)}: expected the K cache as input 1 and the V cache as input 2, got "
                           f"{inputs[K]!r}, {inputs[V]!r}")
    if v_scale != 1.0:
        raise RewriteError(f"{describe(node)}: V is scaled by {v_scale} on its way from the cache")
    kv_heads, head_dim = heads_from_shape(view, k_anchor.past, k_anchor.node, k_anchor.node.output[0])
    common = _common(view, node, head_dim, k_scale)
    return AttentionMatch(
        pattern=NAME, anchor=node, past_key=k_anchor.past, past_value=v_anchor.past,
        present_key=k_anchor.present, present_value=v_anchor.present, q_end=inputs[Q], k_end=k_new, v_end=v_new,
        num_kv_heads=kv_heads, head_dim=head_dim,
        k_path=CachePath(k_anchor.node.output[0], k_end, False, k_scale, kv_heads_ok=True),
        v_path=CachePath(v_anchor.node.output[0], v_end, False, v_scale, kv_heads_ok=True),
        notes=["past concatenated outside the op"], **common)
