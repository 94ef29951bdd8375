"""Projection tracing: from an attention input (q, k or v) back to its projection, through layout ops, the bias,
constant scales, RoPE and per-head norms, tracking which projection column lands at (head, dim).

A projection is a MatMul with a constant 2-D weight on [batch, seq, hidden], or (GPT-2's Conv1D, ``addmm``) a
Gemm on the tokens flattened to [batch * seq, hidden] whose output is reshaped back to [batch, seq, N], its bias
Gemm's C and its weight transposed when transB=1.

``trace_projection`` records the chain (``ProjectionChain``), ``layout_chain`` propagates the projection's
column map along it (``Layout``), ``heads_colmap`` reads the [heads, head_dim] columns at the chain's end and
``follow_output`` finds the o_proj input an attention output becomes through layout ops (and guards). Everything reads a
``GraphView``; nothing changes the model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import onnx

from pagedkv.builder.graph_view import SHAPE_OPS, GraphView, RewriteError, describe

# Ops that only move elements around (reshape, split, transpose...): followed by the layout tracer.
LAYOUT_OPS = {"Reshape", "Transpose", "Slice", "Split", "Squeeze", "Unsqueeze", "Identity", "Cast", "Flatten"}


# ---- layout tracing -----------------------------------------------------------------------------------
@dataclass
class Layout:
    """Where a projection's columns sit in a tensor: ``labels`` per axis ('B' batch, 'S' sequence, 'F'
    feature) and ``colmap`` (one axis per 'F' axis, in order) holding the projection column at each spot."""

    labels: list[str]
    colmap: np.ndarray

    def copy(self) -> "Layout":
        return Layout(list(self.labels), self.colmap.copy())

    @property
    def feature_axes(self) -> list[int]:
        return [i for i, l in enumerate(self.labels) if l == "F"]

    def tokens_first(self) -> list[int]:
        """A Transpose perm that brings B, S to the front and keeps the feature axes in order."""
        return [self.labels.index("B"), self.labels.index("S")] + self.feature_axes


def _ints(view: GraphView, node: onnx.NodeProto, input_index: int, attr: str):
    if len(node.input) > input_index and node.input[input_index]:
        value = view.partial_value(node.input[input_index])  # constants, or static dims read via Shape
        if value is None or None in value:
            raise RewriteError(f"{describe(node)}: expected a constant {attr}, got the computed tensor "
                               f"{node.input[input_index]!r}")
        return value
    value = view.attr(node, attr)
    return None if value is None else [int(v) for v in value]


def apply_layout(view: GraphView, node: onnx.NodeProto, layout: Layout, output: str) -> Layout:
    """The layout of ``output`` of the layout op ``node`` given the layout of its data input."""
    labels, colmap = layout.labels, layout.colmap
    rank = len(labels)
    op = node.op_type
    feature_pos = {axis: k for k, axis in enumerate(layout.feature_axes)}

    def feature_axis(axis: int) -> int:
        axis = axis + rank if axis < 0 else axis
        if labels[axis] != "F":
            raise RewriteError(f"{describe(node)}: expected it to act on a feature axis, it acts on the "
                               f"{'batch' if labels[axis] == 'B' else 'sequence'} axis {axis}")
        return feature_pos[axis]

    if op in ("Identity", "Cast"):
        return layout.copy()
    if op == "Transpose":
        perm = view.attr(node, "perm") or list(reversed(range(rank)))
        new_labels = [labels[p] for p in perm]
        return Layout(new_labels, colmap.transpose([feature_pos[p] for p in perm if labels[p] == "F"]))
    if op == "Slice":
        starts, ends = _ints(view, node, 1, "starts"), _ints(view, node, 2, "ends")
        axes = _ints(view, node, 3, "axes") or list(range(len(starts)))
        steps = _ints(view, node, 4, "steps") or [1] * len(starts)
        index = [slice(None)] * colmap.ndim
        for start, end, axis, step in zip(starts, ends, axes, steps):
            index[feature_axis(axis)] = slice(start, end, step)
        return Layout(list(labels), colmap[tuple(index)])
    if op == "Split":
        axis = feature_axis(view.attr(node, "axis", 0))
        sizes = _ints(view, node, 1, "split")
        n_out = len(node.output)
        total = colmap.shape[axis]
        if sizes is None:
            sizes = [-(-total // n_out)] * n_out
            sizes[-1] = total - sum(sizes[:-1])
        bounds = np.cumsum([0] + sizes)
        k = list(node.output).index(output)
        index = [slice(None)] * colmap.ndim
        index[axis] = slice(int(bounds[k]), int(bounds[k + 1]))
        return Layout(list(labels), colmap[tuple(index)])
    if op in ("Squeeze", "Unsqueeze"):
        axes = _ints(view, node, 1, "axes") or []
        if op == "Squeeze":
            axes = [a + rank if a < 0 else a for a in axes]
            for a in axes:
                feature_axis(a)
            keep = [a for a in range(rank) if a not in axes]
            new_labels = [labels[a] for a in keep]
            new_shape = [colmap.shape[feature_pos[a]] for a in keep if labels[a] == "F"]
            return Layout(new_labels, colmap.reshape(new_shape))
        out_rank = rank + len(axes)
        axes = sorted(a + out_rank if a < 0 else a for a in axes)
        new_labels, it = [], iter(labels)
        for a in range(out_rank):
            new_labels.append("F" if a in axes else next(it))
        last_token = max(i for i, l in enumerate(new_labels) if l in "BS")
        if any(a < last_token for a in axes):
            raise RewriteError(f"{describe(node)}: expected new axes only after the batch and sequence axes")
        return Layout(new_labels, colmap.reshape(_unsqueezed_shape(colmap.shape, new_labels, axes)))
    if op in ("Reshape", "Flatten") and view.same_shape(node.input[0], output):
        return layout.copy()  # e.g. PyTorch's SDPA decomposition reshapes its output to the shape it has
    if op in ("Reshape", "Flatten"):
        token_prefix = 0
        while token_prefix < rank and labels[token_prefix] in "BS":
            token_prefix += 1
        if any(l != "F" for l in labels[token_prefix:]):
            if op == "Reshape" and _keeps_every_axis(view, node, output, labels, colmap):
                return layout.copy()
            raise RewriteError(f"{describe(node)}: expected the batch and sequence axes to lead its input, got "
                               f"axes {labels}")
        out_shape = _reshape_target(view, node, output, labels, colmap, token_prefix)
        return Layout(labels[:token_prefix] + ["F"] * len(out_shape), colmap.reshape(out_shape))
    raise RewriteError(f"{describe(node)}: not a layout op")


def _keeps_every_axis(view: GraphView, node: onnx.NodeProto, output: str, labels, colmap) -> bool:
    """A Reshape to the shape it already has (the legacy exporter's SDPA leaves one on [batch, heads, seq, D],
    target [Shape(x)[0], -1, Shape(q)[2], D]): every feature axis keeps its extent or is the one -1, the batch and
    sequence axes stay runtime dims read off shapes."""
    target = view.partial_value(node.input[1]) if len(node.input) > 1 else None
    if target is None or len(target) != len(labels) or target.count(-1) > 1:
        return False
    extents = iter(colmap.shape)
    for label, value in zip(labels, target):
        if label == "F":
            if value not in (next(extents), 0, -1):
                return False
        elif value is not None and value != 0:
            return False
    return True


def _unsqueezed_shape(shape, new_labels, axes):
    out, it = [], iter(shape)
    for a, label in enumerate(new_labels):
        if label == "F":
            out.append(1 if a in axes else next(it))
    return out


def _reshape_target(view, node, output, labels, colmap, token_prefix) -> list[int]:
    """The feature dims after a Reshape whose leading token axes stay put."""
    size = colmap.size
    static = view.static_shape(output)
    if static is not None and len(static) > token_prefix and all(d is not None for d in static[token_prefix:]):
        feature = list(static[token_prefix:])
        if int(np.prod(feature)) == size:
            return feature
    target = view.partial_value(node.input[1]) if node.op_type == "Reshape" else None
    if target is not None and len(target) > token_prefix:
        feature = [colmap.shape[i - token_prefix] if v == 0 and 0 <= i - token_prefix < colmap.ndim else v
                   for i, v in enumerate(target)][token_prefix:]
        if feature.count(-1) == 1:
            known = int(np.prod([v for v in feature if v != -1]))
            feature[feature.index(-1)] = size // known if known else -1
        if all(v is not None and v > 0 for v in feature) and int(np.prod(feature)) == size:
            return feature
    raise RewriteError(f"{describe(node)}: cannot tell how it splits the {size} features that follow the "
                       f"batch and sequence axes (output shape {static}); expected static trailing dims")


# ---- projection chains --------------------------------------------------------------------------------
@dataclass
class Region:
    """Nodes between ``input`` and ``output`` that are not layout ops: RoPE or a per-head norm."""

    kind: str  # "rope" | "head_norm"
    input: str
    output: str
    nodes: list[onnx.NodeProto]
    layout: Layout | None = None  # at ``input``
    output_layout: Layout | None = None  # at ``output``: the same, or its axes moved by Transposes inside the region


@dataclass
class ProjectionChain:
    """An attention input (q, k or v) traced back to its projection."""

    end: str
    matmul: onnx.NodeProto  # the projection: MatMul or Gemm
    hidden: str  # the projection's data input, [batch, seq, hidden]
    weight: str  # its constant weight: [hidden, N], or [N, hidden] when transposed_weight
    bias: str | None  # a constant [features] added after the MatMul (directly, after layout ops, or Gemm's C)
    steps: list  # source -> end: ("layout", node, out) | ("bias", node) | ("scale", node, factor) | ("region", Region)
    end_layout: Layout | None = None
    output: str = ""  # the projection's columns as [batch, seq, N] (MatMul: its output; Gemm: reshaped back)
    transposed_weight: bool = False  # Gemm with transB=1
    bias_columns: np.ndarray | None = None  # the projection column each bias entry is added to (layout_chain)

    def weight_matrix(self, view: GraphView) -> np.ndarray:
        """The weight as [hidden, N] (the orientation of ``hidden @ weight``)."""
        weight = view.constant(self.weight)
        return weight.T if self.transposed_weight else weight

    def bias_values(self, view: GraphView, width: int) -> np.ndarray:
        """The bias per projection column ([width]; zeros where none is added)."""
        out = np.zeros(width, dtype=np.float64)
        if self.bias is not None:
            value = np.asarray(view.constant(self.bias), dtype=np.float64)
            out[self.bias_columns] = np.broadcast_to(value, self.bias_columns.shape)
        return out

    @property
    def regions(self) -> list[Region]:
        return [s[1] for s in self.steps if s[0] == "region"]

    def region(self, kind: str) -> Region | None:
        found = [r for r in self.regions if r.kind == kind]
        return found[0] if found else None

    def scale_after(self, tensor: str | None) -> float:
        """Product of the constant scale factors between ``tensor`` (None: the projection) and the end."""
        factor, counting = 1.0, tensor is None
        for s in self.steps:
            if s[0] == "region" and s[1].input == tensor:
                counting = True
            if counting and s[0] == "scale":
                factor *= s[2]
        return factor


HEAD_NORM_OPS = {"Pow", "Mul", "ReduceMean", "Add", "Sqrt", "Div", "Reciprocal", "Cast", "Sub",
                 "SimplifiedLayerNormalization", "RMSNormalization", "LayerNormalization"}


def _projection_weight(view: GraphView, node: onnx.NodeProto) -> str | None:
    if node.op_type == "Gemm":
        if (len(node.input) < 2 or view.attr(node, "transA", 0) != 0 or view.attr(node, "alpha", 1.0) != 1.0
                or view.attr(node, "beta", 1.0) != 1.0):
            return None
    elif node.op_type != "MatMul" or len(node.input) != 2:
        return None
    weight = view.constant(node.input[1])
    return node.input[1] if weight is not None and weight.ndim == 2 and min(weight.shape) > 1 else None


def _gemm_tokens(view: GraphView, gemm: onnx.NodeProto) -> tuple[str, str]:
    """A Gemm projection on flattened tokens: (its [batch, seq, hidden] input before the flattening Reshape, its
    output reshaped back to [batch, seq, N])."""
    flat = view.producer.get(gemm.input[0])
    hidden = flat.input[0] if flat is not None and flat.op_type in ("Reshape", "Flatten") else None
    users = [n for n in view.consumers.get(gemm.output[0], []) if n.op_type not in SHAPE_OPS]
    width = view.constant(gemm.input[1]).shape[0 if view.attr(gemm, "transB", 0) else 1]
    target = view.partial_value(users[0].input[1]) if len(users) == 1 and users[0].op_type == "Reshape" else None
    hidden_rank = len(view.static_shape(hidden) or []) if hidden else 0
    if hidden_rank != 3 or target is None or len(target) != 3 or target[2] != width:
        raise RewriteError(f"{describe(gemm)}: expected a projection on flattened tokens: Reshape([batch, seq, hidden] "
                           f"-> [-1, hidden]) -> Gemm -> Reshape(-> [batch, seq, {width}]), found input "
                           f"{gemm.input[0]!r} from {describe(flat) if flat is not None else 'a graph input'} and "
                           f"output consumers {[describe(u) for u in users]}")
    return hidden, users[0].output[0]


def find_projection(view: GraphView, end: str) -> onnx.NodeProto:
    """The nearest MatMul (or Gemm) with a constant 2-D weight above ``end`` (data edges only)."""
    seen, todo = set(), deque([end])
    while todo:
        t = todo.popleft()
        if t in seen or t not in view.producer:
            continue
        seen.add(t)
        node = view.producer[t]
        if _projection_weight(view, node):
            return node
        todo.extend(view.data_inputs(node))
    consumer = view.consumers.get(end, [None])[0]
    raise RewriteError(f"tensor {end!r}{' (input of ' + describe(consumer) + ')' if consumer else ''}: expected a "
                       "projection MatMul (or Gemm) with a constant weight above it, found none")


def _dominator(view: GraphView, source: str, target: str, region_set: set[str]) -> str:
    """The tensor nearest to ``target`` that every data path from ``source`` to it crosses."""
    candidates = sorted((t for t in region_set if t not in (source, target) and t in view.producer),
                        key=lambda t: -view.order(view.producer[t]))
    for cut in candidates + [source]:
        if cut == source:
            return source
        seen, todo = {source}, deque([source])
        while todo:
            t = todo.popleft()
            for node in view.consumers.get(t, []):
                if node.op_type in SHAPE_OPS:
                    continue
                for out in node.output:
                    if out in region_set and out != cut and out not in seen:
                        seen.add(out)
                        todo.append(out)
        if target not in seen:
            return cut
    return source


def trace_projection(view: GraphView, end: str) -> ProjectionChain:
    """Walk from ``end`` back to its projection; record layout ops, bias, scales and regions."""
    matmul = find_projection(view, end)
    hidden, source, bias, transposed = matmul.input[0], matmul.output[0], None, False
    if matmul.op_type == "Gemm":
        hidden, source = _gemm_tokens(view, matmul)
        transposed = bool(view.attr(matmul, "transB", 0))
        if len(matmul.input) > 2 and matmul.input[2]:
            bias = matmul.input[2]
            if view.constant(bias) is None or view.constant(bias).size != view.constant(matmul.input[1]).shape[
                    0 if transposed else 1]:
                raise RewriteError(f"{describe(matmul)}: expected a constant bias of one value per output column")
    data = view.descendants(source) & view.ancestors([end], stop={source})
    steps, t = [], end
    while t != source:
        node = view.producer[t]
        inputs = [i for i in view.data_inputs(node) if i in data]
        const_inputs = [i for i in node.input if i and view.is_constant(i)]
        if node.op_type in LAYOUT_OPS and inputs == [node.input[0]]:
            steps.append(("layout", node, t))
            t = node.input[0]
        elif (node.op_type == "Add" and len(inputs) == 1 and len(const_inputs) == 1 and bias is None
              and view.constant(const_inputs[0]).ndim == 1):
            bias = const_inputs[0]  # right after the MatMul, or after the Split of a packed one (ORT's fusions)
            steps.append(("bias", node))
            t = inputs[0]
        elif (node.op_type in ("Mul", "Div") and len(inputs) == 1 and len(const_inputs) == 1
              and view.constant(const_inputs[0]).size == 1):
            if node.op_type == "Div" and node.input[1] != const_inputs[0]:
                raise RewriteError(f"{describe(node)}: expected x / constant, got constant / x")
            value = view.scalar(const_inputs[0])
            steps.append(("scale", node, value if node.op_type == "Mul" else 1.0 / value))
            t = inputs[0]
        else:
            x = _dominator(view, source, t, data)
            inner = view.descendants(x) & view.ancestors([t], stop={x}) & data
            by_order = {view.order(view.producer[o]): view.producer[o] for o in inner if o != x and o in view.producer}
            nodes = [by_order[k] for k in sorted(by_order)]
            side = {i for n in nodes for i in view.data_inputs(n) if i not in inner}
            # RoPE's cos/sin come from positions: position_ids, or the past length a Shape reads (a cos/sin cache
            # sliced from the past length on, as transformers 4.x's Gemma writes it); a norm's side inputs are constants
            dynamic_side = any(view.depends_on_inputs(s, shapes=True) for s in side)
            kind = "rope" if dynamic_side or any("Rotary" in n.op_type for n in nodes) else "head_norm"
            if kind == "head_norm":
                _check_head_norm(view, nodes)
            steps.append(("region", Region(kind, x, t, nodes)))
            t = x
    steps.reverse()
    return ProjectionChain(end, matmul, hidden, matmul.input[1], bias, steps, output=source,
                           transposed_weight=transposed)


def _check_head_norm(view: GraphView, nodes) -> None:
    for node in nodes:
        if node.op_type not in HEAD_NORM_OPS:
            raise RewriteError(f"{describe(node)}: expected RoPE or a per-head norm between the projection and "
                               f"the attention, found a {node.op_type} that depends on no position input")
        if node.op_type in ("ReduceMean", "RMSNormalization", "SimplifiedLayerNormalization", "LayerNormalization"):
            rank = len(view.static_shape(node.input[0]) or [])
            axes = _ints(view, node, 1, "axes") if node.op_type == "ReduceMean" else [view.attr(node, "axis", -1)]
            if axes is None or any(a not in (-1, rank - 1) for a in axes):
                raise RewriteError(f"{describe(node)}: a per-head norm must reduce over the last axis "
                                   f"(head_dim), got axes={axes}")


def layout_chain(view: GraphView, chain: ProjectionChain) -> Layout:
    """Propagate the projection's column map to ``chain.end``; stores each region's layout on the way."""
    width = chain.weight_matrix(view).shape[1]
    layout = Layout(["B", "S", "F"], np.arange(width))
    chain.bias_columns = layout.colmap  # Gemm's C is added to the projection's own columns; a bias step moves it
    out_rank = len(view.static_shape(chain.output) or [3])
    if out_rank != 3 and out_rank >= 2:  # (shape inference past unknown ops can leave a bogus rank < 2)
        raise RewriteError(f"{describe(chain.matmul)}: expected a [batch, seq, features] projection, "
                           f"got rank {out_rank}")
    for s in chain.steps:
        if s[0] == "layout":
            layout = apply_layout(view, s[1], layout, s[2])
        elif s[0] == "region":
            s[1].layout = layout.copy()
            layout = s[1].output_layout = _region_output_layout(view, s[1])
        elif s[0] == "bias":
            size = view.constant(chain.bias).size
            if layout.labels[-1] != "F" or layout.colmap.shape[-1] != size:
                raise RewriteError(f"{describe(s[1])}: expected the bias ({size}) added along the features "
                                   f"of a {layout.labels} tensor with features {list(layout.colmap.shape)}")
            chain.bias_columns = layout.colmap
    chain.end_layout = layout
    return layout


def _region_output_layout(view: GraphView, region: Region) -> Layout:
    """The layout at a region's output. Elementwise regions keep their input's; ORT's transpose optimizer can
    leave Transposes inside one (RoPE applied in [B, H, S, D] to an input in [B, S, H, D]): their perms are
    composed along every data path from the input to the output (which must agree), and the result moves the
    input's axes like a Transpose of the whole region."""
    layout = region.layout
    if not any(n.op_type == "Transpose" for n in region.nodes):
        return layout.copy()
    rank = len(layout.labels)
    perms = {region.input: list(range(rank))}  # tensor -> output axis i holds input axis perm[i]
    for node in region.nodes:  # in graph order
        found = [perms[i] for i in view.data_inputs(node) if i in perms]
        if not found:
            continue
        if any(p != found[0] for p in found):
            raise RewriteError(f"{describe(node)}: the {region.kind} region from {region.input!r} reaches it with "
                               f"its axes in different orders {found}")
        perm = found[0]
        if node.op_type == "Transpose":
            perm = [perm[a] for a in (view.attr(node, "perm") or list(reversed(range(rank))))]
        elif node.op_type in ("Reshape", "Unsqueeze", "Squeeze", "Flatten") and perm != list(range(rank)):
            raise RewriteError(f"{describe(node)}: expected no reshape after a Transpose inside the {region.kind} "
                               f"region from {region.input!r}")
        for out in node.output:
            perms[out] = perm
    perm = perms[region.output]
    feature_pos = {axis: k for k, axis in enumerate(layout.feature_axes)}
    return Layout([layout.labels[p] for p in perm],
                  layout.colmap.transpose([feature_pos[p] for p in perm if layout.labels[p] == "F"]))


def heads_colmap(chain: ProjectionChain, heads: int, head_dim: int, where: onnx.NodeProto,
                 packed: tuple[int, int] | None = None) -> np.ndarray:
    """[heads, head_dim] projection columns of the chain's end, for a [B, N, S, D], [B, S, N, D] or
    [B, S, N*D] end. ``packed`` = (offset, width): the end is [B, S, width] holding several attention inputs side
    by side (packed QKV), this one the heads * head_dim features from ``offset``."""
    layout = chain.end_layout
    if packed is not None:
        offset, width = packed
        if layout.labels == ["B", "S", "F"] and layout.colmap.size == width:
            return layout.colmap[offset:offset + heads * head_dim].reshape(heads, head_dim)
        raise RewriteError(f"{describe(where)}: expected the packed input {chain.end!r} as [batch, seq, {width}], "
                           f"traced axes {layout.labels} with features {list(layout.colmap.shape)}")
    if layout.labels in (["B", "F", "S", "F"], ["B", "S", "F", "F"]) or layout.labels == ["B", "S", "F"]:
        if layout.colmap.size == heads * head_dim:
            return layout.colmap.reshape(heads, head_dim)
    raise RewriteError(f"{describe(where)}: expected input {chain.end!r} as [batch, {heads} heads, seq, {head_dim}] "
                       f"(or [batch, seq, {heads * head_dim}]), traced axes {layout.labels} with "
                       f"features {list(layout.colmap.shape)}")


def guard_condition(view: GraphView, node: onnx.NodeProto, tensor: str) -> str | None:
    """The condition ``c`` of a guard ``Where(c, 0, tensor)`` (PyTorch's SDPA decompositions zero the outputs of
    queries that see no key), when ``node`` is one and ``c`` is not computed from ``tensor``; else None."""
    if node.op_type != "Where" or len(node.input) != 3 or node.input[2] != tensor:
        return None
    zero = view.constant(node.input[1])
    if zero is None or np.any(zero != 0) or tensor in view.ancestors([node.input[0]]):
        return None
    return node.input[0]


def follow_output(view: GraphView, tensor: str, labels: list[str], heads: int, head_dim: int,
                  where: onnx.NodeProto) -> tuple[str, list[str]]:
    """From an attention output with axes ``labels`` ([B, H, S, D] or [B, S, H*D]...), follow layout ops and
    guards (``guard_condition``: elementwise, the layout stays) to the last tensor that holds it as
    [batch, seq, heads * head_dim] in (head, dim) order: the o_proj input; or as [batch * seq, heads * head_dim]
    when the exporter flattens the tokens straight into a Gemm o_proj (dynamo's GPT-2 Conv1D). -> (that tensor,
    the conditions of the guards passed on the way: the rewrite measures them false, ``measure.measure_guard``)."""
    layout = Layout(list(labels), np.arange(heads * head_dim).reshape(
        [heads, head_dim] if labels.count("F") == 2 else [heads * head_dim]))
    found, guards, passed = None, [], []
    while True:
        if layout.labels == ["B", "S", "F"] and np.array_equal(layout.colmap, np.arange(heads * head_dim)):
            found, guards = tensor, list(passed)
        users = [n for n in view.consumers.get(tensor, []) if n.op_type not in SHAPE_OPS]
        if (layout.labels[:2] == ["B", "S"] and set(layout.labels[2:]) == {"F"} and len(users) == 1
                and users[0].op_type == "Reshape" and users[0].input[0] == tensor
                and np.array_equal(layout.colmap.ravel(), np.arange(heads * head_dim))
                and view.partial_value(users[0].input[1]) == [-1, heads * head_dim]):
            return users[0].output[0], list(passed)  # the tokens flattened: [batch * seq, heads * head_dim]
        condition = guard_condition(view, users[0], tensor) if len(users) == 1 else None
        if condition is not None:
            passed.append(condition)
            tensor = users[0].output[0]
            continue
        if len(users) == 1 and users[0].op_type in LAYOUT_OPS and users[0].input[0] == tensor:
            try:
                layout = apply_layout(view, users[0], layout, users[0].output[0])
                tensor = users[0].output[0]
                continue
            except RewriteError:
                if found is None:
                    raise
        if found is not None:
            return found, guards
        raise RewriteError(f"{describe(where)}: expected its output to become [batch, seq, {heads}*{head_dim}] "
                           f"in (head, dim) order through layout ops, got axes {layout.labels} feeding "
                           f"{[describe(u) for u in users]}")
