"""ONNX's own ``Attention`` op (opset 23; the dynamo exporter at opset 23), usually after ``RotaryEmbedding``::

    Attention(Q [B, H, S, D], K [B, KVH, S, D], V, attn_mask, past_key, past_value)
        -> Y [B, H, S, D] -> Transpose -> Reshape -> o_proj,  present_key, present_value

The op repeats K/V heads itself (query head h reads KV head h // (H / KVH)), takes ``scale`` and ``softcap``
as attributes and the mask as a bool (True: attend) or additive float input.
"""

from __future__ import annotations

import math

from pagedkv.builder.graph_info import GraphView, RewriteError, describe, follow_output
from pagedkv.builder.patterns import AttentionMatch, KVAnchor, heads_from_shape

NAME = "onnx_attention"
ANCHOR_OPS = {("", "Attention")}
Q, K, V, MASK, PAST_K, PAST_V = range(6)


def match(view: GraphView, anchors: list[KVAnchor]) -> list[AttentionMatch]:
    nodes = {}
    for anchor in anchors:
        nodes.setdefault(anchor.node.name or id(anchor.node), anchor.node)
    matches = []
    for node in nodes.values():
        inputs = list(node.input) + [""] * (6 - len(node.input))
        if not inputs[PAST_K] or not inputs[PAST_V] or len(node.output) < 3:
            raise RewriteError(f"{describe(node)}: expected past_key, past_value inputs and present outputs")
        if GraphView.attr(node, "qk_matmul_output_mode", 0) or (len(node.output) > 3 and node.output[3]):
            raise RewriteError(f"{describe(node)}: the qk_matmul output is not supported")
        kv_heads, head_dim = heads_from_shape(view, inputs[PAST_K], node)
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
        out_labels = labels if len(labels) == 4 else ["B", "S", "F"]
        matches.append(AttentionMatch(
            pattern=NAME, anchor=node, past_key=view.source_input(inputs[PAST_K]), past_value=view.source_input(inputs[PAST_V]),
            present_key=node.output[1], present_value=node.output[2], q_end=inputs[Q], k_end=inputs[K],
            v_end=inputs[V], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            out=follow_output(view, node.output[0], out_labels, heads, head_dim, node), scale=float(scale),
            logit_softcap=float(GraphView.attr(node, "softcap", 0.0)), mask=mask,
            window=0 if mask is None else None))
    return matches
