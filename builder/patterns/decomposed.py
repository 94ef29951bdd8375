"""Fully decomposed attention (PyTorch's legacy exporter, transformers' eager/SDPA paths, the synthetic
``decomposed`` and ``contrib_rotary`` forms)::

    past_k ─┐                                        past_v ─┐
    k ──────Concat(axis 2) ─> present.k              v ──────Concat(axis 2) ─> present.v
              └ [element-moving ops: the GQA repeat,            └ [element-moving ops]
                 K^T, flatten/unflatten; Mul sqrt(s)]             │
    q [Mul sqrt(s)] ─ MatMul ─ [Mul|Div s] ─ [Div cap ─ Tanh ─ Mul cap] ─ Add(mask)|Where ─ Softmax(-1)
      ─ [Where(IsNaN(p), 0, p)] ─ MatMul ─ Transpose ─ Reshape ─> o_proj

The optional Tanh between scalar factors is Gemma-2's attention logit soft-cap, cap * tanh(s * qk / cap): the
factors after the Tanh are the cap, those before it the softmax scale over the cap. The Where over IsNaN after
the Softmax (PyTorch's SDPA decompositions) zeroes the probabilities of fully masked rows, which causal attention
never has.

When the (repeated) caches reach the opset-23 ``Attention`` op instead of the two MatMuls (the dynamo exporter
at opset 23 with SDPA), ``onnx_attention.match_concat`` reads the op.
"""

from __future__ import annotations

import numpy as np
import onnx

from pagedkv.builder.graph_view import GraphView, RewriteError, describe
from pagedkv.builder.projection import follow_output, layout_chain, trace_projection
from pagedkv.builder.patterns import AttentionMatch, CachePath, KVAnchor, heads_from_shape, onnx_attention

NAME = "decomposed"
ANCHOR_OPS = {("", "Concat"): None}  # the Concat's output is the present
PASS_OPS = {"Cast", "Identity"}
MOVE_OPS = {"Unsqueeze", "Squeeze", "Expand", "Tile", "Reshape", "Transpose", *PASS_OPS}


def _next(view: GraphView, tensor: str, where: onnx.NodeProto) -> onnx.NodeProto:
    """The one data consumer of ``tensor`` (Shape readers and graph outputs aside)."""
    users = [n for n in view.consumers.get(tensor, []) if n.op_type not in ("Shape", "Size")]
    if len(users) != 1:
        raise RewriteError(f"{describe(where)}: expected {tensor!r} to feed exactly one node on the way to "
                           f"attention, it feeds {[describe(u) for u in users]}")
    return users[0]


def _scalar_factor(view: GraphView, node: onnx.NodeProto, data: str) -> float | None:
    """x * c, c * x or x / c with a constant scalar c -> the factor; else None."""
    if node.op_type not in ("Mul", "Div"):
        return None
    other = [i for i in node.input if i != data]
    if len(other) != 1 or view.scalar(other[0]) is None:
        return None
    if node.op_type == "Div":
        if node.input[0] != data:
            return None
        return 1.0 / view.scalar(other[0])
    return view.scalar(other[0])


def _follow_cache(view: GraphView, anchor: KVAnchor):
    """cache -> (the MatMul or Attention op it reaches, input index there, the tensor entering it, constant factor on
    the way). The ops between only move elements (MOVE_OPS: the GQA repeat, transposes, the flatten/unflatten
    reshapes of exporters' SDPA decompositions) or scale them; what they do is measured by the rewrite
    (``measure.measure_cache_path``), so no op order is assumed here."""
    t, scale = anchor.node.output[0], 1.0
    while True:
        node = _next(view, t, anchor.node)
        if node.op_type == "MatMul" or (node.op_type == "Attention" and (node.domain or "") == ""):
            return node, list(node.input).index(t), t, scale
        factor = _scalar_factor(view, node, t)
        if factor is not None:
            scale *= factor
        elif node.op_type not in MOVE_OPS or node.input[0] != t:
            raise RewriteError(f"{describe(node)}: expected the cache {anchor.present!r} to reach a MatMul (or the "
                               f"opset-23 Attention op) through element-moving ops ({', '.join(sorted(MOVE_OPS))}) "
                               f"and constant scales, found {node.op_type}")
        t = node.output[0]


def _reads_probabilities(view: GraphView, matmul: onnx.NodeProto) -> bool:
    """Whether the MatMul's first input is a Softmax's probabilities (through casts and a NaN guard): MatMul(P, V)."""
    t = matmul.input[0]
    while t in view.producer:
        node = view.producer[t]
        if node.op_type == "Softmax":
            return True
        if node.op_type in PASS_OPS:
            t = node.input[0]
        elif node.op_type == "Where" and len(node.input) == 3 and view.producer.get(node.input[0]) is not None \
                and view.producer[node.input[0]].op_type == "IsNaN":
            t = node.input[2]
        else:
            return False
    return False


def _scores_to_softmax(view: GraphView, scores_mm: onnx.NodeProto):
    """QK^T MatMul -> (Softmax, scale, soft-cap, mask tensor, mask is boolean-visible). With a soft-cap
    ``c * tanh(s * qk)`` the scale returned is ``s * c`` (the plugin's softmax_scale) and the cap ``c``."""
    t, scale, mask, true_visible = scores_mm.output[0], 1.0, None, True
    tanh, cap = None, 1.0  # the soft-cap's Tanh and the product of the factors after it
    while True:
        node = _next(view, t, scores_mm)
        factor = _scalar_factor(view, node, t)
        if factor is not None:
            if tanh is None:
                scale *= factor
            else:
                cap *= factor
        elif node.op_type == "Add" and mask is None:
            mask = next(i for i in node.input if i != t)
        elif node.op_type == "Where" and mask is None:
            if node.input[1] == t:
                mask, true_visible = node.input[0], True
            elif node.input[2] == t:
                mask, true_visible = node.input[0], False
            else:
                raise RewriteError(f"{describe(node)}: expected the scores as a Where branch")
        elif node.op_type == "Softmax":
            rank = len(view.static_shape(t) or [4])
            axis = GraphView.attr(node, "axis", -1 if view.opsets.get("", 13) >= 13 else 1)
            if axis not in (-1, rank - 1):
                raise RewriteError(f"{describe(node)}: expected Softmax over the last axis (the keys), got axis={axis}")
            if tanh is None:
                return node, scale, 0.0, mask, true_visible
            if not cap > 0:
                raise RewriteError(f"{describe(tanh)}: expected the soft-cap c * tanh(x / c) with c > 0, the factors "
                                   f"after the Tanh multiply by {cap}")
            return node, scale * cap, cap, mask, true_visible
        elif node.op_type == "Tanh":
            if tanh is not None or mask is not None:
                raise RewriteError(f"{describe(node)}: expected one soft-cap Tanh on the scores before the mask, "
                                   f"found {'a second Tanh' if tanh is not None else 'it after the mask'}")
            tanh = node
        elif node.op_type not in PASS_OPS:
            raise RewriteError(f"{describe(node)}: expected scale, mask and Softmax after the QK^T MatMul "
                               f"{scores_mm.name!r}, found {node.op_type}")
        t = node.output[0]


def _nan_guard(view: GraphView, probs: str) -> onnx.NodeProto | None:
    """``Where(IsNaN(p), 0, p)`` on the probabilities (PyTorch's SDPA decomposition zeroes the rows a mask hides
    completely, which softmax turns into NaN): the Where, or None. Every query attends at least itself under the
    plugins' causal masks, so no row is ever fully hidden there and the guard changes nothing."""
    users = [n for n in view.consumers.get(probs, []) if n.op_type not in ("Shape", "Size")]
    isnan = [n for n in users if n.op_type == "IsNaN"]
    where = [n for n in users if n.op_type == "Where"]
    if len(users) != 2 or len(isnan) != 1 or len(where) != 1:
        return None
    guard = where[0]
    zero = view.constant(guard.input[1])
    if guard.input[0] != isnan[0].output[0] or guard.input[2] != probs or zero is None or np.any(zero != 0):
        return None
    return guard


def _softmax_to_pv(view: GraphView, softmax: onnx.NodeProto) -> onnx.NodeProto:
    t = softmax.output[0]
    while True:
        guard = _nan_guard(view, t)
        if guard is not None:
            t = guard.output[0]
            continue
        node = _next(view, t, softmax)
        if node.op_type == "MatMul" and node.input[0] == t:
            return node
        if node.op_type not in PASS_OPS:
            raise RewriteError(f"{describe(node)}: expected the probabilities to enter MatMul(probs, V), found "
                               f"{node.op_type}")
        t = node.output[0]


def _concat_inputs(view: GraphView, anchor: KVAnchor) -> str:
    node = anchor.node
    rank = len(view.static_shape(anchor.past) or [4])
    axis = GraphView.attr(node, "axis")
    if axis not in (2, 2 - rank):
        raise RewriteError(f"{describe(node)}: expected the past/new Concat along the sequence axis 2, got axis={axis}")
    if len(node.input) != 2 or node.input[0] != anchor.entry:
        raise RewriteError(f"{describe(node)}: expected Concat(past {anchor.entry!r}, new), got inputs {list(node.input)}")
    return node.input[1]


def match(view: GraphView, anchors: list[KVAnchor]) -> list[AttentionMatch]:
    keys, values = {}, {}  # QK^T MatMul -> anchor info; PV MatMul -> anchor info
    fused: dict = {}  # opset-23 Attention op fed by the caches -> {input index: its anchor info}
    for anchor in anchors:
        new = _concat_inputs(view, anchor)
        matmul, index, end, scale = _follow_cache(view, anchor)
        if matmul.op_type == "Attention":
            if index not in (onnx_attention.K, onnx_attention.V):
                raise RewriteError(f"{describe(matmul)}: expected the cache {anchor.present!r} as its K or V input, "
                                   f"got input {index}")
            fused.setdefault(matmul.name or id(matmul), (matmul, {}))[1][index] = (anchor, new, end, scale)
        elif index != 1:
            raise RewriteError(f"{describe(matmul)}: expected the cache {anchor.present!r} as its second input "
                               f"(MatMul(q, K^T) or MatMul(P, V)), got input {index}")
        elif _reads_probabilities(view, matmul):
            values[matmul.name or id(matmul)] = (anchor, new, matmul, CachePath(anchor.node.output[0], end, False,
                                                                               scale))
        else:
            keys[matmul.name or id(matmul)] = (anchor, new, matmul, CachePath(anchor.node.output[0], end, True, scale))
    matches = []
    for node, caches in fused.values():
        if set(caches) != {onnx_attention.K, onnx_attention.V}:
            raise RewriteError(f"{describe(node)}: expected both the K and the V cache to reach it from past/present "
                               f"Concats, found only input(s) {sorted(caches)}")
        matches.append(onnx_attention.match_concat(view, node, caches[onnx_attention.K], caches[onnx_attention.V]))
    for anchor, k_new, scores_mm, k_path in keys.values():
        softmax, score_scale, softcap, mask, true_visible = _scores_to_softmax(view, scores_mm)
        pv = _softmax_to_pv(view, softmax)
        value = values.pop(pv.name or id(pv), None)
        if value is None:
            raise RewriteError(f"{describe(pv)}: expected its V input to come from a past/present Concat")
        v_anchor, v_new, _, v_path = value
        if v_path.scale != 1.0:
            raise RewriteError(f"{describe(pv)}: V is scaled by {v_path.scale} on its way from the cache")
        if mask is None:
            raise RewriteError(f"{describe(softmax)}: expected a mask (Add or Where) on the scores before it")
        kv_heads, head_dim = heads_from_shape(view, anchor.past, anchor.node, anchor.node.output[0])
        pv_shape = view.static_shape(pv.output[0])
        q_heads = pv_shape[1] if pv_shape and len(pv_shape) == 4 and pv_shape[1] else None
        if q_heads is None:
            q_shape = view.static_shape(scores_mm.input[0])
            q_heads = q_shape[1] if q_shape and len(q_shape) == 4 else None
        if q_heads is None:  # shapes unknown (e.g. after contrib ops): count the heads the q chain delivers
            chain = trace_projection(view, scores_mm.input[0])
            q_heads = layout_chain(view, chain).colmap.size // head_dim
        out, guards = _output_to_projection(view, pv, q_heads, head_dim)
        matches.append(AttentionMatch(
            pattern=NAME, anchor=scores_mm, past_key=anchor.past, past_value=v_anchor.past,
            present_key=anchor.present, present_value=v_anchor.present, q_end=scores_mm.input[0], k_end=k_new,
            v_end=v_new, num_heads=int(q_heads), num_kv_heads=kv_heads, head_dim=head_dim, out=out,
            scale=k_path.scale * score_scale, logit_softcap=softcap, mask=mask, mask_true_visible=true_visible,
            k_path=k_path, v_path=v_path, guards=guards, notes=[f"softmax {softmax.name!r}"]))
    if values:
        anchor = next(iter(values.values()))[0]
        raise RewriteError(f"{describe(anchor.node)}: the V cache {anchor.present!r} reaches a MatMul that no "
                           "Softmax feeds")
    return matches


def _output_to_projection(view: GraphView, pv: onnx.NodeProto, heads: int, head_dim: int) -> tuple[str, list[str]]:
    return follow_output(view, pv.output[0], ["B", "F", "S", "F"], heads, head_dim, pv)
