"""Registered attention structures. Each module recognizes one way exporters write attention and turns it
into an ``AttentionMatch``: the q/k/v tensors that enter attention, the past/present tensors, the attention
output, and what the structure itself says about heads, scale, mask and window.

The search starts from the past-KV graph inputs (``find_kv_anchors``): each enters a node that produces a
graph output, its present. Which output that is, is the anchoring pattern's knowledge: its ``ANCHOR_OPS``.

Adding a structure: write a module with ``NAME``, ``ANCHOR_OPS`` (``{(domain, op_type): present slots}``: the
ops a past-KV input enters, each with ``{past input index: present output index}``, or None when the op's own
output is the present, as for the past/new Concat) and ``match(view, anchors) -> list[AttentionMatch]``, and
list it in ``REGISTRY``. The shared work (tracing q/k/v back to the projections, measuring RoPE and the mask,
emitting the plugin nodes) stays in ``pagedkv.builder.rewrite`` (with ``projection`` and ``measure``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from pagedkv.builder.graph_view import GraphView, RewriteError, describe


@dataclass(frozen=True)
class KVAnchor:
    """A past-KV graph input, the node it enters and the graph output (present) that node produces."""

    past: str  # the graph input
    node: onnx.NodeProto
    present: str
    entry: str  # the tensor that enters ``node``: the past input or an identity alias of it


@dataclass(frozen=True)
class CachePath:
    """How a present cache [B, KVH, L, D] reaches attention through element-moving ops (the GQA repeat, transposes,
    exporters' flatten/unflatten reshapes) and constant factors. What ``end`` holds is measured, not parsed
    (``measure.measure_cache_path``): head h must read KV head h // (H / KVH), and positions and dims must land as
    ``transposed`` says."""

    start: str  # the present (the past/new Concat's output)
    end: str  # the tensor the MatMul or attention op reads
    transposed: bool  # end is [B, H, D, L] (K of MatMul(q, K^T)); else [B, H, L, D]
    scale: float = 1.0  # the constant factors on the way
    kv_heads_ok: bool = False  # end may keep the KV heads (an op that repeats them itself)


@dataclass
class AttentionMatch:
    pattern: str
    anchor: onnx.NodeProto  # the node errors and the report name
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    q_end: str  # attention inputs (after RoPE), traced back to the projections by the rewrite
    k_end: str
    v_end: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    out: str  # attention output as [batch, seq, heads * head_dim], the o_proj input
    scale: float  # softmax scale found outside the q chain (the q chain's own factors are added later)
    logit_softcap: float = 0.0
    mask: str | None = None  # in-graph mask to measure, or None when `window` is known
    mask_true_visible: bool = True  # boolean masks: True = attend
    window: int | None = None
    sinks: int = 0
    rope_tables: tuple[np.ndarray, np.ndarray, int] | None = None  # (cos, sin, interleaved) inside the op
    packed_qkv: bool = False  # q_end = k_end = v_end holds [q heads | k heads | v heads] on its last axis
    k_path: CachePath | None = None  # the present K's way to attention, when the graph has one
    v_path: CachePath | None = None  # the same for V
    guards: list[str] = field(default_factory=list)  # conditions of Where(c, 0, x) guards: measured always false
    notes: list[str] = field(default_factory=list)


def heads_from_shape(view: GraphView, past: str, node: onnx.NodeProto, present: str | None = None) -> tuple[int, int]:
    """(kv_heads, head_dim) off the past input [batch, kv_heads, past, head_dim], or off its ``present`` where the
    past's are symbolic (transformers' exporter names them "2", "64": dim_params, not values)."""
    for tensor in (past, present) if present else (past,):
        shape = view.static_shape(tensor)
        if shape and len(shape) == 4 and shape[1] is not None and shape[3] is not None:
            return int(shape[1]), int(shape[3])
    raise RewriteError(f"{describe(node)}: expected past input {past!r} as [batch, kv_heads, past, head_dim] "
                       f"with static kv_heads and head_dim, got {view.static_shape(past)}"
                       + (f" (its present {present!r}: {view.static_shape(present)})" if present else ""))


def anchor_nodes(anchors: list[KVAnchor]) -> list[onnx.NodeProto]:
    """The distinct op nodes the anchors of a single-op pattern point at (a node anchors both K and V)."""
    nodes = {}
    for anchor in anchors:
        nodes.setdefault(anchor.node.name or id(anchor.node), anchor.node)
    return list(nodes.values())


def find_kv_anchors(view: GraphView) -> list[KVAnchor]:
    """Rank-4 graph inputs that enter a node which produces a graph output."""
    outputs = set(view.graph_outputs)
    anchors = []
    for name in view.graph_inputs:
        shape = view.static_shape(name)
        if shape is None or len(shape) != 4:
            continue
        entries, todo = [], [name]
        while todo:  # the input and its identity aliases (exporters wrap the past in a one-input Concat)
            t = todo.pop()
            entries.append(t)
            todo += [n.output[0] for n in view.consumers.get(t, []) if view.source_input(n.output[0]) == name
                     and n.output[0] not in outputs]
        for entry in entries:
            for node in view.consumers.get(entry, []):
                produced = [p for p in (_graph_output_of(view, o, outputs) for o in node.output) if p]
                if node.op_type in ("Shape", "Size") or not produced or (node.output[0] in entries):
                    continue
                present = _present(node, list(node.input).index(entry), produced)
                anchors.append(KVAnchor(name, node, present, entry))
    return anchors


def _graph_output_of(view: GraphView, tensor: str, outputs: set[str]) -> str | None:
    """The graph output ``tensor`` is, or becomes through Identity / Cast (GPT-J casts the present)."""
    while tensor not in outputs:
        users = [n for n in view.consumers.get(tensor, []) if n.op_type in ("Identity", "Cast")]
        if len(users) != 1:
            return None
        tensor = users[0].output[0]
    return tensor


def _present(node: onnx.NodeProto, input_index: int, produced: list[str]) -> str:
    """The present of the past entering ``node`` at ``input_index``, by the anchoring pattern's slots (an op no
    pattern knows keeps its output 0: ``match_all`` then names it as unrecognized)."""
    key = (node.domain or "", node.op_type)
    slots = next((p.ANCHOR_OPS[key] for p in REGISTRY if key in p.ANCHOR_OPS), {})
    if slots is None:  # the op's own output is the present (the past/new Concat)
        return produced[0]
    slot = slots.get(input_index)
    return node.output[slot] if slot is not None and len(node.output) > slot else node.output[0]


from pagedkv.builder.patterns import contrib_gqa, decomposed, onnx_attention  # noqa: E402

REGISTRY = (decomposed, onnx_attention, contrib_gqa)


def match_all(view: GraphView, anchors: list[KVAnchor]) -> list[AttentionMatch]:
    by_pattern: dict = {}
    for anchor in anchors:
        key = (anchor.node.domain or "", anchor.node.op_type)
        pattern = next((p for p in REGISTRY if key in p.ANCHOR_OPS), None)
        if pattern is None:
            known = sorted(f"{d + '::' if d else ''}{op}" for p in REGISTRY for d, op in p.ANCHOR_OPS)
            raise RewriteError(f"{describe(anchor.node)}: past input {anchor.past!r} enters it, but no pattern "
                               f"recognizes a {key[1]} there (known: {', '.join(known)})")
        by_pattern.setdefault(pattern, []).append(anchor)
    matches = []
    for pattern, group in by_pattern.items():
        matches += pattern.match(view, group)
    return matches
