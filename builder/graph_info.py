"""Reading an exported decoder graph: an index over the ONNX protos, a subgraph evaluator, and the tracers
that read attention parameters off it.

Everything here reads; nothing changes the model. The rewrite (``rewrite.py``) and the pattern modules
(``patterns/``) build on three tools:

* ``GraphView``: producers, consumers, constants, static shapes (onnx shape inference with data propagation),
  ancestors/descendants that ignore ``Shape`` edges (a tensor's shape is not its data).
* ``GraphView.evaluate``: runs a slice of the graph in ONNX Runtime with chosen tensors fed, graph inputs set by
  a ``ProbeStep`` (batch, past, seq). Parameters that are easier to measure than to parse (RoPE frequencies,
  the mask's window, the GQA head mapping) are measured this way, on the graph's own ops.
* ``trace_projection``: walks from an attention input (q, k or v) back to its projection MatMul through
  layout ops, the bias, RoPE and head norms, and tracks which projection column lands at (head, dim).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from pagedkv.config import RopeConfig, RopeScaling, RopeStyle


class RewriteError(ValueError):
    """The graph does not match what the rewrite expects; the message names the node and the expectation."""


def describe(node: onnx.NodeProto) -> str:
    return f"{node.op_type} node {node.name or '<unnamed>'!r}"


# Ops whose outputs carry no data of their inputs, only shapes: never followed as data edges.
SHAPE_OPS = {"Shape", "Size"}
# Ops that only move elements around (reshape, split, transpose...): followed by the layout tracer.
LAYOUT_OPS = {"Reshape", "Transpose", "Slice", "Split", "Squeeze", "Unsqueeze", "Identity", "Cast", "Flatten"}


def _is_identity(node: onnx.NodeProto) -> bool:
    """Nodes exporters leave that pass their one input through unchanged (torch.cat of one tensor...)."""
    return node.op_type == "Identity" or (node.op_type == "Concat" and len([i for i in node.input if i]) == 1)


# ONNX Runtime's fused ops that onnx's shape inference has no schema for (ORT's transformer optimizer writes
# them outside attention): (domain, op) -> the outputs that have the shape and type of input 0. Without this,
# inference stops at the first of them and every shape downstream (Reshape targets, Slice ends) is unknown.
SHAPE_PRESERVING_FOREIGN_OPS = {
    ("", "SimplifiedLayerNormalization"): (0,),
    ("com.microsoft", "SimplifiedLayerNormalization"): (0,),
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): (0, 3),
    ("com.microsoft", "SkipLayerNormalization"): (0, 3),
    ("com.microsoft", "FastGelu"): (0,),
    ("com.microsoft", "BiasGelu"): (0,),
    ("com.microsoft", "Gelu"): (0,),
    ("com.microsoft", "QuickGelu"): (0,),
}


def _infer_shapes(model: onnx.ModelProto) -> onnx.GraphProto:
    """The model's graph with shape inference's value_info; ORT's shape-preserving fused ops stand in as
    Identity nodes for the inference only (the nodes returned are the model's own)."""
    nodes, changed = [], False
    for node in model.graph.node:
        keep = SHAPE_PRESERVING_FOREIGN_OPS.get((node.domain or "", node.op_type))
        if keep is None or (not node.domain and onnx.defs.has(node.op_type)):
            nodes.append(node)
            continue
        changed = True
        nodes += [onnx.helper.make_node("Identity", [node.input[0]], [node.output[i]])
                  for i in keep if i < len(node.output) and node.output[i]]
    surrogate = model
    if changed:
        surrogate = copy.deepcopy(model)
        del surrogate.graph.node[:]
        surrogate.graph.node.extend(nodes)
    try:
        inferred = onnx.shape_inference.infer_shapes(surrogate, data_prop=True).graph
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        return model.graph
    if changed:
        del inferred.node[:]
        inferred.node.extend(model.graph.node)
    return inferred


# ---- the index ----------------------------------------------------------------------------------------
class GraphView:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = _infer_shapes(model)
        self.opsets = {o.domain: o.version for o in model.opset_import}
        self.nodes = list(self.graph.node)
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for out in node.output:
                if out:
                    self.producer[out] = node
            for inp in node.input:
                if inp:
                    self.consumers.setdefault(inp, []).append(node)
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.value_info = {v.name: v for v in (*self.graph.input, *self.graph.output, *self.graph.value_info)}
        self.graph_inputs = [i.name for i in self.graph.input if i.name not in self.initializers]
        self.graph_outputs = [o.name for o in self.graph.output]
        self._order = {id(n): i for i, n in enumerate(self.nodes)}
        self._const_cache: dict[str, np.ndarray | None] = {}
        self._sessions: dict = {}

    # ---- constants and shapes -----------------------------------------------------------------------
    def constant(self, name: str) -> np.ndarray | None:
        """The value of an initializer or a Constant node's output (through Identity), else None."""
        if name in self._const_cache:
            return self._const_cache[name]
        value = None
        if name in self.initializers:
            value = numpy_helper.to_array(self.initializers[name])
        elif name in self.producer:
            node = self.producer[name]
            if node.op_type == "Constant":
                attr = node.attribute[0]
                value = (numpy_helper.to_array(attr.t) if attr.name == "value" else
                         np.asarray(onnx.helper.get_attribute_value(attr)))
            elif node.op_type == "Identity":
                value = self.constant(node.input[0])
        self._const_cache[name] = value
        return value

    def partial_value(self, name: str) -> list[int | None] | None:
        """A 1-D int tensor's entries where they are constant (None where they come from a runtime shape),
        through the Shape -> Gather -> Unsqueeze -> Concat chains exporters build Reshape targets with."""
        const = self.constant(name)
        if const is not None:
            return [int(v) for v in np.asarray(const).reshape(-1)]
        node = self.producer.get(name)
        if node is None:
            return None
        if node.op_type == "Concat":
            parts = [self.partial_value(i) for i in node.input]
            return None if any(p is None for p in parts) else [v for p in parts for v in p]
        if node.op_type in ("Unsqueeze", "Squeeze", "Cast", "Identity"):
            inner = self.partial_value(node.input[0])
            return inner if inner is not None and len(inner) == 1 else None
        if node.op_type == "Shape":
            dims = self.static_shape(node.input[0])
            start, end = self.attr(node, "start", 0), self.attr(node, "end", None)
            return None if dims is None else dims[start:end] if end is not None else dims[start:]
        if node.op_type == "Gather":  # of a shape: Gather(Shape(x), i), or of a permuted one (ORT folds
            index = self.constant(node.input[1])  # Shape(Transpose(x)) into Gather(Shape(x), perm))
            if index is None:
                return None
            table = self.constant(node.input[0])
            dims = self.partial_value(node.input[0]) if table is None or table.ndim == 1 else None
            if dims is None:
                source = self.producer.get(node.input[0])
                return [None] * max(1, index.size) if source is not None and source.op_type == "Shape" else None
            picks = [int(i) for i in index.reshape(-1)]
            if GraphView.attr(node, "axis", 0) != 0 or any(not -len(dims) <= i < len(dims) for i in picks):
                return None
            return [dims[i] for i in picks]
        if node.op_type in ("Add", "Sub", "Mul", "Div") and len(node.input) == 2:
            a, b = self.partial_value(node.input[0]), self.partial_value(node.input[1])
            if a is None or b is None or (len(a) != len(b) and 1 not in (len(a), len(b))):
                return None
            n = max(len(a), len(b))
            a, b = a * n if len(a) == 1 else a, b * n if len(b) == 1 else b
            ops = {"Add": lambda x, y: x + y, "Sub": lambda x, y: x - y, "Mul": lambda x, y: x * y,
                   "Div": lambda x, y: x // y}
            return [None if x is None or y is None else ops[node.op_type](x, y) for x, y in zip(a, b)]
        return None

    def source_input(self, name: str) -> str | None:
        """The graph input ``name`` is an identity alias of (through Identity or a one-input Concat), if any."""
        while name not in self.graph_inputs:
            node = self.producer.get(name)
            if node is None or not _is_identity(node):
                return None
            name = node.input[0]
        return name

    def is_constant(self, name: str) -> bool:
        return self.constant(name) is not None

    def scalar(self, name: str) -> float | None:
        value = self.constant(name)
        return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None

    def static_shape(self, name: str) -> list[int | None] | None:
        """Dims from shape inference: ints where static, None where symbolic; None when unknown."""
        const = self.constant(name)
        if const is not None:
            return list(const.shape)
        info = self.value_info.get(name)
        if info is None or not info.type.tensor_type.HasField("shape"):
            return None
        return [d.dim_value if d.HasField("dim_value") else None for d in info.type.tensor_type.shape.dim]

    def dim_names(self, name: str) -> list[str | int | None] | None:
        info = self.value_info.get(name)
        if info is None or not info.type.tensor_type.HasField("shape"):
            return None
        return [d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else None
                for d in info.type.tensor_type.shape.dim]

    def elem_type(self, name: str) -> int | None:
        if name in self.initializers:
            return self.initializers[name].data_type
        info = self.value_info.get(name)
        return info.type.tensor_type.elem_type if info is not None else None

    @staticmethod
    def attr(node: onnx.NodeProto, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    def order(self, node: onnx.NodeProto) -> int:
        return self._order[id(node)]

    # ---- reachability (data edges only) -------------------------------------------------------------
    def data_inputs(self, node: onnx.NodeProto) -> list[str]:
        return [] if node.op_type in SHAPE_OPS else [i for i in node.input if i]

    def ancestors(self, tensors, stop: set[str] = frozenset()) -> set[str]:
        seen, todo = set(), deque(tensors)
        while todo:
            t = todo.popleft()
            if t in seen:
                continue
            seen.add(t)
            if t in stop or t not in self.producer:
                continue
            todo.extend(self.data_inputs(self.producer[t]))
        return seen

    def descendants(self, tensor: str) -> set[str]:
        seen, todo = set(), deque([tensor])
        while todo:
            t = todo.popleft()
            if t in seen:
                continue
            seen.add(t)
            for node in self.consumers.get(t, []):
                if node.op_type not in SHAPE_OPS:
                    todo.extend(o for o in node.output if o)
        return seen

    def depends_on_inputs(self, tensor: str) -> set[str]:
        """Graph inputs the value of ``tensor`` depends on (shapes excluded)."""
        return self.ancestors([tensor]) & set(self.graph_inputs)

    # ---- evaluation ---------------------------------------------------------------------------------
    def evaluate(self, outputs: list[str], feeds: dict[str, np.ndarray], step: "ProbeStep") -> list[np.ndarray]:
        """Run the part of the graph that computes ``outputs`` from ``feeds`` (internal tensors allowed)
        and the graph inputs as ``step`` sets them, in ONNX Runtime on the CPU."""
        import onnxruntime as ort

        key = (tuple(outputs), tuple(sorted(feeds)))
        if key not in self._sessions:
            model, shape_feeds = self._extract(outputs, feeds, step)
            options = ort.SessionOptions()
            options.log_severity_level = 4  # a sin/cos table too short for a probe is expected, not news
            self._sessions[key] = (ort.InferenceSession(model.SerializeToString(), options,
                                                        providers=["CPUExecutionProvider"]), shape_feeds)
        session, shape_feeds = self._sessions[key]
        names = {i.name for i in session.get_inputs()}
        inputs = dict(feeds)
        for name, node in shape_feeds.items():
            shape = np.asarray(step.shape(self.source_input(node.input[0])), dtype=np.int64)
            start, end = self.attr(node, "start", 0), self.attr(node, "end", None)
            inputs[name] = shape[start:end] if end is not None else shape[start:]
        for name in names - set(inputs):
            inputs[name] = step.feed(name)
        return session.run(outputs, {k: v for k, v in inputs.items() if k in names})

    def _extract(self, outputs, feeds, step) -> onnx.ModelProto:
        needed, todo, seen, shape_feeds = [], deque(outputs), set(), {}
        used_inputs, initializers = set(), set()
        while todo:
            t = todo.popleft()
            if t in seen or t in feeds:
                continue
            seen.add(t)
            if t in self.initializers:
                initializers.add(t)
                continue
            if t in self.graph_inputs:
                used_inputs.add(t)
                continue
            node = self.producer.get(t)
            if node is None:
                raise RewriteError(f"tensor {t!r} has no producer, initializer or graph input")
            source = self.source_input(node.input[0]) if node.op_type == "Shape" else None
            if source is not None and step.has_shape(source):
                shape_feeds[t] = node  # the input's shape is known: fed as a value, never the big tensor
                continue
            needed.append(("node", node))
            todo.extend(i for i in node.input if i)
        unique = {self.order(node): node for _, node in needed}  # a multi-output node is reached once per output
        nodes = [unique[k] for k in sorted(unique)]
        graph_inputs = [onnx.helper.make_tensor_value_info(name, self._feed_type(name, feeds), None)
                        for name in sorted(set(feeds))]
        graph_inputs += [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None)
                         for name in sorted(shape_feeds)]
        graph_inputs += [self.value_info[name] for name in sorted(used_inputs)]
        graph_outputs = [onnx.helper.make_empty_tensor_value_info(name) for name in outputs]
        graph = onnx.helper.make_graph(nodes, "probe", graph_inputs, graph_outputs,
                                       [self.initializers[n] for n in sorted(initializers)])
        model = onnx.helper.make_model(graph, opset_imports=list(self.model.opset_import))
        model.ir_version = self.model.ir_version
        return model, shape_feeds

    def _feed_type(self, name: str, feeds) -> int:
        return onnx.helper.np_dtype_to_tensor_dtype(np.asarray(feeds[name]).dtype)


# ---- graph inputs of a probe step ---------------------------------------------------------------------
INPUT_ROLES = ("input_ids", "attention_mask", "position_ids", "past_key", "past_value")


@dataclass
class ProbeStep:
    """Concrete graph inputs for an evaluation: ``batch`` sequences with ``past`` cached tokens and ``seq``
    new ones at positions past..past+seq-1, no padding. Past tensors are only ever fed as shapes."""

    roles: dict[str, str]  # graph input -> role (INPUT_ROLES)
    past_shape: dict[str, tuple[int, int]]  # past input -> (kv_heads, head_dim)
    batch: int = 1
    past: int = 0
    seq: int = 1
    int_types: dict[str, np.dtype] = field(default_factory=dict)

    def has_shape(self, name: str) -> bool:
        return name in self.roles

    def shape(self, name: str) -> tuple[int, ...]:
        role = self.roles[name]
        if role in ("past_key", "past_value"):
            kv_heads, head_dim = self.past_shape[name]
            return (self.batch, kv_heads, self.past, head_dim)
        if role == "attention_mask":
            return (self.batch, self.past + self.seq)
        return (self.batch, self.seq)

    def feed(self, name: str) -> np.ndarray:
        role = self.roles.get(name)
        if role is None:
            raise RewriteError(f"graph input {name!r} is needed to read a parameter, but its role is unknown "
                               f"(known roles: {INPUT_ROLES})")
        dtype = self.int_types.get(name, np.int64)
        if role == "attention_mask":
            return np.ones(self.shape(name), dtype=dtype)
        if role == "position_ids":
            return np.broadcast_to(np.arange(self.past, self.past + self.seq), self.shape(name)).astype(dtype)
        if role == "input_ids":
            return np.zeros(self.shape(name), dtype=dtype)
        return np.zeros(self.shape(name), dtype=np.float32)

    def at(self, batch: int, past: int, seq: int) -> "ProbeStep":
        return ProbeStep(self.roles, self.past_shape, batch, past, seq, self.int_types)


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
    if op in ("Reshape", "Flatten"):
        token_prefix = 0
        while token_prefix < rank and labels[token_prefix] in "BS":
            token_prefix += 1
        if any(l != "F" for l in labels[token_prefix:]):
            raise RewriteError(f"{describe(node)}: expected the batch and sequence axes to lead its input, got "
                               f"axes {labels}")
        out_shape = _reshape_target(view, node, output, labels, colmap, token_prefix)
        return Layout(labels[:token_prefix] + ["F"] * len(out_shape), colmap.reshape(out_shape))
    raise RewriteError(f"{describe(node)}: not a layout op")


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
    layout: Layout | None = None  # at ``input`` (same at ``output``)


@dataclass
class ProjectionChain:
    """An attention input (q, k or v) traced back to its projection."""

    end: str
    matmul: onnx.NodeProto
    hidden: str  # the projection's data input
    weight: str  # its constant [hidden, N] weight
    bias: str | None  # a constant added right after the MatMul
    steps: list  # source -> end: ("layout", node, out) | ("bias", node) | ("scale", node, factor) | ("region", Region)
    end_layout: Layout | None = None

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
    if node.op_type != "MatMul" or len(node.input) != 2:
        return None
    weight = view.constant(node.input[1])
    return node.input[1] if weight is not None and weight.ndim == 2 and weight.shape[0] > 1 else None


def find_projection(view: GraphView, end: str) -> onnx.NodeProto:
    """The nearest MatMul with a constant 2-D weight above ``end`` (data edges only)."""
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
                       "projection MatMul with a constant weight above it, found none")


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
    source = matmul.output[0]
    data = view.descendants(source) & view.ancestors([end], stop={source})
    steps, bias, t = [], None, end
    while t != source:
        node = view.producer[t]
        inputs = [i for i in view.data_inputs(node) if i in data]
        const_inputs = [i for i in node.input if i and view.is_constant(i)]
        if node.op_type in LAYOUT_OPS and inputs == [node.input[0]]:
            steps.append(("layout", node, t))
            t = node.input[0]
        elif (node.op_type == "Add" and len(inputs) == 1 and inputs[0] == source and len(const_inputs) == 1
              and view.constant(const_inputs[0]).ndim == 1):
            bias = const_inputs[0]
            steps.append(("bias", node))
            t = source
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
            dynamic_side = any(view.depends_on_inputs(s) for s in side)
            kind = "rope" if dynamic_side or any("Rotary" in n.op_type for n in nodes) else "head_norm"
            if kind == "head_norm":
                _check_head_norm(view, nodes)
            steps.append(("region", Region(kind, x, t, nodes)))
            t = x
    steps.reverse()
    return ProjectionChain(end, matmul, matmul.input[0], matmul.input[1], bias, steps)


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
    width = view.constant(chain.weight).shape[1]
    layout = Layout(["B", "S", "F"], np.arange(width))
    out_rank = len(view.static_shape(chain.matmul.output[0]) or [3])
    if out_rank != 3 and out_rank >= 2:  # (shape inference past unknown ops can leave a bogus rank < 2)
        raise RewriteError(f"{describe(chain.matmul)}: expected a [batch, seq, features] projection, "
                           f"got rank {out_rank}")
    for s in chain.steps:
        if s[0] == "layout":
            layout = apply_layout(view, s[1], layout, s[2])
        elif s[0] == "region":
            s[1].layout = layout.copy()
    chain.end_layout = layout
    return layout


def heads_colmap(chain: ProjectionChain, heads: int, head_dim: int, where: onnx.NodeProto) -> np.ndarray:
    """[heads, head_dim] projection columns of the chain's end, for a [B, N, S, D], [B, S, N, D] or
    [B, S, N*D] end."""
    layout = chain.end_layout
    if layout.labels in (["B", "F", "S", "F"], ["B", "S", "F", "F"]) or layout.labels == ["B", "S", "F"]:
        if layout.colmap.size == heads * head_dim:
            return layout.colmap.reshape(heads, head_dim)
    raise RewriteError(f"{describe(where)}: expected input {chain.end!r} as [batch, {heads} heads, seq, {head_dim}] "
                       f"(or [batch, seq, {heads * head_dim}]), traced axes {layout.labels} with "
                       f"features {list(layout.colmap.shape)}")


def follow_output(view: GraphView, tensor: str, labels: list[str], heads: int, head_dim: int,
                  where: onnx.NodeProto) -> str:
    """From an attention output with axes ``labels`` ([B, H, S, D] or [B, S, H*D]...), follow layout ops to
    the tensor that holds it as [batch, seq, heads * head_dim] in (head, dim) order: the o_proj input."""
    layout = Layout(list(labels), np.arange(heads * head_dim).reshape(
        [heads, head_dim] if labels.count("F") == 2 else [heads * head_dim]))
    while True:
        if layout.labels == ["B", "S", "F"] and np.array_equal(layout.colmap, np.arange(heads * head_dim)):
            return tensor
        users = [n for n in view.consumers.get(tensor, []) if n.op_type not in SHAPE_OPS]
        if len(users) != 1 or users[0].op_type not in LAYOUT_OPS or users[0].input[0] != tensor:
            raise RewriteError(f"{describe(where)}: expected its output to become [batch, seq, {heads}*{head_dim}] "
                               f"in (head, dim) order through layout ops, got axes {layout.labels} feeding "
                               f"{[describe(u) for u in users]}")
        layout = apply_layout(view, users[0], layout, users[0].output[0])
        tensor = users[0].output[0]


# ---- RoPE measurement ---------------------------------------------------------------------------------
LADDER = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)  # positions: each at most 4x the last (unwrapping)


@dataclass
class RopeMeasurement:
    style: RopeStyle
    rotary_dim: int
    inv_freq: np.ndarray  # [R/2] measured
    max_position: int  # largest position measured


def _unwrap_inv_freq(positions: list[int], angles: np.ndarray) -> np.ndarray:
    """angles [len(positions), R/2] in (-pi, pi] -> inverse frequencies, unwrapping 2*pi turns
    from each position to the next (each position at most 4x the previous one)."""
    freq = angles[0] / positions[0]
    for p, a in zip(positions[1:], angles[1:]):
        predicted = freq * p
        turns = np.round((predicted - a) / (2 * np.pi))
        freq = (a + 2 * np.pi * turns) / p
    return freq


def measure_rope(view: GraphView, region: Region, step: ProbeStep, heads_map: np.ndarray,
                 chain: ProjectionChain | None = None) -> RopeMeasurement:
    """Run the RoPE region on unit vectors at positions 0 and LADDER; read pairs, rotary dim, frequencies.

    ``heads_map`` [heads, D] gives, for each (head, dim), the index into the region input's flattened
    feature axes. ``chain`` (the projection chain the region sits on): its hidden-state input is fed as zeros
    too, so that a Shape read inside the region (the sin/cos or the reshape taking the batch from q) stops at
    this layer's input instead of pulling in every layer before it (ORT's graph optimizations share such reads;
    the earlier layers would then run at the ladder's long positions on past caches of that length)."""
    layout = region.layout
    heads, D = heads_map.shape
    feat_shape = layout.colmap.shape
    perm_to_tokens = layout.tokens_first()
    inverse = np.argsort(perm_to_tokens)
    hidden_feed = {}
    if chain is not None:
        weight = view.constant(chain.weight)
        hidden_feed[chain.hidden] = np.zeros((D, 1, weight.shape[0]), dtype=weight.dtype)

    def run(position: int) -> np.ndarray:  # -> M [D out, D in] per head: [heads, D, D]
        x = np.zeros((D, 1, int(np.prod(feat_shape))), dtype=np.float32)  # [basis, seq, features]
        for d in range(D):
            x[d, 0, heads_map[:, d]] = 1.0
        x = x.reshape((D, 1) + feat_shape).transpose(inverse)
        dtype = _np_dtype(view.elem_type(region.input))
        (y,) = view.evaluate([region.output], {region.input: x.astype(dtype), **hidden_feed},
                             step.at(D, position, 1))
        y = np.asarray(y, dtype=np.float64).transpose(perm_to_tokens).reshape(D, -1)  # [basis, features]
        return np.stack([y[:, heads_map[h]].T for h in range(heads)])  # [heads, out d, in d]

    node = region.nodes[-1]
    zero = run(0)
    if not np.allclose(zero, np.eye(D), atol=1e-5):
        raise RewriteError(f"{describe(node)}: expected RoPE (identity at position 0); the region from "
                           f"{region.input!r} to {region.output!r} is not")
    positions, mats = [], []
    for p in LADDER:
        try:
            m = run(p)
        except RewriteError:
            raise
        except Exception:  # noqa: BLE001 - a finite sin/cos table ends the ladder
            if not positions:
                raise
            break
        if not np.allclose(m, m[:1], atol=1e-5):
            raise RewriteError(f"{describe(node)}: expected the same rotation for every head")
        positions.append(p)
        mats.append(m[0])
    # Dims past the rotary dim are copied: exactly the identity. Rotated dims move at some position, however
    # slowly (a llama3-scaled low frequency turns by ~1e-4 rad at position 1024: exact comparison sees it).
    moving = np.zeros(D, dtype=bool)
    for m in mats:
        off = m - np.diag(np.diag(m))
        moving |= (np.diag(m) != 1.0) | np.any(off != 0, axis=0) | np.any(off != 0, axis=1)
    R = int(moving.sum())
    if R == 0 or R % 2 or not moving[:R].all():
        raise RewriteError(f"{describe(node)}: expected RoPE on the leading dims of each head, rotated dims "
                           f"are {np.flatnonzero(moving).tolist()}")
    candidates = {RopeStyle.NEOX: (np.arange(R // 2), np.arange(R // 2, R)),
                  RopeStyle.GPTJ: (np.arange(0, R, 2), np.arange(1, R, 2))}
    for style, (first, second) in candidates.items():
        sin = np.stack([m[second, first] for m in mats])  # x = e_a -> b gets sin
        cos = np.stack([m[first, first] for m in mats])
        ok = all(np.allclose(m[first, second], -m[second, first], atol=1e-5) and
                 np.allclose(m[second, second], m[first, first], atol=1e-5) for m in mats)
        if ok and np.allclose(sin ** 2 + cos ** 2, 1.0, atol=1e-4):
            angles = np.arctan2(sin, cos)
            return RopeMeasurement(style, R, _unwrap_inv_freq(positions, angles), positions[-1])
    raise RewriteError(f"{describe(node)}: expected a rotate-half (NeoX) or interleaved (GPT-J) rotation of "
                       f"unit scale on the first {R} dims")


def rope_from_tables(cos: np.ndarray, sin: np.ndarray, style: RopeStyle) -> RopeMeasurement:
    """Measure from position-indexed cos/sin caches [max_positions, R/2]."""
    positions = [p for p in LADDER if p < cos.shape[0]]
    angles = np.arctan2(sin[positions].astype(np.float64), cos[positions].astype(np.float64))
    return RopeMeasurement(style, 2 * cos.shape[1], _unwrap_inv_freq(positions, angles), positions[-1])


def _snap(theta: float) -> float:
    r = round(theta)
    return float(r) if r > 0 and abs(theta - r) <= 1e-5 * theta else theta


def fit_rope_config(m: RopeMeasurement, head_dim: int, where: str) -> RopeConfig:
    """A RopeConfig whose inverse frequencies reproduce the measured ones (NONE, LINEAR, then LLAMA3)."""
    from pagedkv.reference.rope import rope_inv_freq

    f = m.inv_freq
    R = m.rotary_dim
    x = np.arange(0, R, 2) / R
    rotary_dim = 0 if R == head_dim else R
    # 2e-6 relative: the graph's float32 frequencies and angles; plus what a 1e-3 rad drift at max_position allows
    tol = 2e-6 * f + 1e-3 / m.max_position

    def matches(cfg: RopeConfig) -> bool:
        return bool(np.all(np.abs(rope_inv_freq(head_dim, cfg) - f) <= tol))

    def fit_theta(values) -> float:
        y = -np.log(values)
        return _snap(float(np.exp((x[1:] @ y[1:]) / (x[1:] @ x[1:])))) if len(x) > 1 else 10000.0

    base = RopeConfig(style=m.style, rotary_dim=rotary_dim, theta=fit_theta(f))
    if matches(base):
        return base
    factor = float(1.0 / f[0])
    linear = RopeConfig(style=m.style, rotary_dim=rotary_dim, theta=fit_theta(f * factor),
                        scaling=RopeScaling.LINEAR, factor=_snap(factor))
    if matches(linear):
        return linear
    if len(f) > 2 and abs(f[0] - 1.0) < 1e-6:
        theta = _snap(float((f[0] / f[1]) ** (R / 2)))
        unscaled = theta ** (-x)
        factor = _snap(float(unscaled[-1] / f[-1]))
        llama3 = RopeConfig(style=m.style, rotary_dim=rotary_dim, theta=theta, scaling=RopeScaling.LLAMA3,
                            factor=factor)
        if matches(llama3):
            return llama3
        # other (low, high, original) triples: smooth = a * inv_freq + b on the blended band
        ratio = f / unscaled
        smooth = (ratio - 1.0 / factor) / (1.0 - 1.0 / factor)
        band = (smooth > 1e-4) & (smooth < 1 - 1e-4)
        if band.sum() >= 2:
            a, b = np.polyfit(unscaled[band], smooth[band], 1)
            low = 1.0
            high = low - low / b
            original = int(round(a * 2 * math.pi * (high - low)))
            llama3 = RopeConfig(style=m.style, rotary_dim=rotary_dim, theta=theta, scaling=RopeScaling.LLAMA3,
                                factor=factor, low_freq_factor=low, high_freq_factor=float(high),
                                original_max_positions=original)
            if matches(llama3):
                return llama3
    raise RewriteError(f"{where}: the measured RoPE frequencies match no supported scaling (none, linear, llama3); "
                       f"inv_freq[:4]={f[:4].tolist()}, inv_freq[-2:]={f[-2:].tolist()}")


def _np_dtype(elem_type: int | None):
    if elem_type is None:
        return np.float32
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type)


# ---- mask measurement ---------------------------------------------------------------------------------
@dataclass
class MaskMeasurement:
    window: int  # 0: full causal
    sinks: int


def _visible(mask: np.ndarray, boolean_true_visible: bool, node) -> np.ndarray:
    m = np.asarray(mask)
    while m.ndim > 2:
        m = m[0]
    if m.dtype == np.bool_:
        return m if boolean_true_visible else ~m
    m = m.astype(np.float64)
    visible, hidden = m == 0, m <= -1e4
    if not np.all(visible | hidden):
        bad = m[~(visible | hidden)][:3].tolist()
        raise RewriteError(f"{describe(node)}: expected the mask to add 0 (visible) or a large negative value "
                           f"(masked), it adds {bad} (a position bias such as ALiBi is not supported)")
    return visible


def measure_mask(view: GraphView, mask: str, step: ProbeStep, node, true_is_visible: bool = True,
                 ladder=(8, 64, 512, 4096, 32768)) -> MaskMeasurement:
    """Evaluate the in-graph mask at decode steps of growing length (the window), then check it against
    ``attends`` at prefill and chunked steps."""
    from pagedkv.layout import attends

    window, sinks = 0, 0
    for total in ladder:
        (m,) = view.evaluate([mask], {}, step.at(1, total - 1, 1))
        row = _visible(m, true_is_visible, node)[-1]
        if row.shape[0] != total:
            raise RewriteError(f"{describe(node)}: expected a mask row over {total} positions, got {row.shape[0]}")
        if not row.all():
            visible = np.flatnonzero(row)
            tail = visible[visible >= total - visible.size]
            window = int(len(tail)) if tail.size and tail[-1] == total - 1 else 0
            sinks = int(visible.size - tail.size)
            if window == 0 or not np.array_equal(visible[:sinks], np.arange(sinks)):
                raise RewriteError(f"{describe(node)}: expected a causal mask with an optional window and sink "
                                   f"positions; the last query of {total} sees {visible.tolist()[:16]}...")
            break
    checks = [(0, 7), (5, 4), (window + 3, 5)] if window else [(0, 7), (5, 4)]
    for past, seq in checks:
        (m,) = view.evaluate([mask], {}, step.at(1, past, seq))
        got = _visible(m, true_is_visible, node)
        q_pos = np.arange(past, past + seq)[:, None]
        kv_pos = np.arange(past + seq)[None, :]
        want = attends(q_pos, kv_pos, window, sinks)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise RewriteError(f"{describe(node)}: expected a causal mask (window={window}, sinks={sinks}); at "
                               f"past={past}, seq={seq} it differs:\n{got.astype(int)}")
    return MaskMeasurement(window, sinks)


def measure_head_mapping(view: GraphView, start: str, end: str, kv_heads: int, heads: int, head_dim: int,
                         step: ProbeStep, node) -> None:
    """Check that the GQA repeat between ``start`` [B, KVH, L, D] and ``end`` [B, H, L, D] gives head h
    the KV head h // (H / KVH), as the plugin does."""
    if start == end:
        if heads != kv_heads:
            raise RewriteError(f"{describe(node)}: {heads} query heads read {kv_heads} KV heads without a repeat")
        return
    x = np.broadcast_to(np.arange(kv_heads, dtype=np.float32)[None, :, None, None], (1, kv_heads, 3, head_dim))
    (y,) = view.evaluate([end], {start: np.ascontiguousarray(x)}, step.at(1, 0, 3))
    y = np.asarray(y)
    want = (np.arange(heads) // (heads // kv_heads)).astype(np.float32)
    if y.shape != (1, heads, 3, head_dim) or not np.array_equal(y[0, :, 0, 0], want):
        got = y[0, :, 0, 0].tolist() if y.ndim == 4 else list(y.shape)
        raise RewriteError(f"{describe(node)}: expected the GQA repeat to give query head h the KV head "
                           f"h // {heads // kv_heads}, got {got}")
