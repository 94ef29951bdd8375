"""Reading an exported decoder graph: an index over the ONNX protos and a subgraph evaluator.

Everything here reads; nothing changes the model. The rewrite (``rewrite.py``), the projection tracer
(``projection.py``), the measurements (``measure.py``) and the pattern modules (``patterns/``) build on:

* ``GraphView``: producers, consumers, constants, static shapes (onnx shape inference with data propagation),
  ancestors/descendants that ignore ``Shape`` edges (a tensor's shape is not its data).
* ``GraphView.evaluate``: runs a slice of the graph in ONNX Runtime with chosen tensors fed, graph inputs set by
  a ``ProbeStep`` (batch, past, seq). Parameters that are easier to measure than to parse (RoPE frequencies,
  the mask's window, the GQA head mapping) are measured this way, on the graph's own ops (``measure.py``).
* ``RewriteError`` and ``describe``: how every reader of the builder says what it expected where.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from pagedkv import onnx_io


class RewriteError(ValueError):
    """The graph does not match what the rewrite expects; the message names the node and the expectation."""


class NotADecoderError(RewriteError):
    """The graph is no decoder-with-past at all (no past K/V inputs): the user handed over the wrong file."""


def describe(node: onnx.NodeProto) -> str:
    return f"{node.op_type} node {node.name or '<unnamed>'!r}"


# Ops whose outputs carry no data of their inputs, only shapes: never followed as data edges.
SHAPE_OPS = {"Shape", "Size"}


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


# Ops ONNX Runtime's symbolic shape inference has no rule for, whose output 0 has the shape of input 0: the opset-23
# Attention op (Y [B, H, S, D] of Q [B, H, S, D], V's head size being Q's in every decoder the rewrite takes).
SYMBOLIC_STAND_INS = {("", "Attention")}


def inferred_value_info(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Inputs, outputs and intermediate tensors with shape inference's types and shapes. Inferred on the model's
    weightless skeleton (``onnx_io.skeleton``: big weights become inputs of their shape, so a model of any size
    serializes, and external data is never read); ORT's shape-preserving fused ops stand in as Identity nodes."""
    surrogate = onnx_io.skeleton(model)
    nodes, changed = [], False
    for node in surrogate.graph.node:
        keep = SHAPE_PRESERVING_FOREIGN_OPS.get((node.domain or "", node.op_type))
        if keep is None or (not node.domain and onnx.defs.has(node.op_type)):
            nodes.append(node)
            continue
        changed = True
        nodes += [onnx.helper.make_node("Identity", [node.input[0]], [node.output[i]])
                  for i in keep if i < len(node.output) and node.output[i]]
    if changed:
        del surrogate.graph.node[:]
        surrogate.graph.node.extend(nodes)
    graph = surrogate.graph
    try:
        graph = onnx.shape_inference.infer_shapes(surrogate, data_prop=True).graph
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        pass
    return [*graph.input, *graph.output, *graph.value_info]


# ---- the index ----------------------------------------------------------------------------------------
def _symbolic_shape_infer():
    """ONNX Runtime's ``tools/symbolic_shape_infer.py``, loaded from its file: importing it as
    ``onnxruntime.tools.symbolic_shape_infer`` runs the package's ``__init__``, which imports torch when it is
    installed (~240 MB of resident memory in every rewrite, for a module that needs only onnx, numpy and sympy)."""
    import importlib.util
    import sys

    name = "_pagedkv_ort_symbolic_shape_infer"
    if name not in sys.modules:
        ort = importlib.util.find_spec("onnxruntime")
        path = Path(next(iter(ort.submodule_search_locations))) / "tools" / "symbolic_shape_infer.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


class GraphView:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
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
        self.value_info = {v.name: v for v in inferred_value_info(model)}
        self.graph_inputs = [i.name for i in self.graph.input if i.name not in self.initializers]
        self.graph_outputs = [o.name for o in self.graph.output]
        self._order = {id(n): i for i, n in enumerate(self.nodes)}
        self._const_cache: dict[str, np.ndarray | None] = {}
        self._sessions: dict = {}
        self._symbolic: dict[str, list] | None = None

    # ---- constants and shapes -----------------------------------------------------------------------
    def constant(self, name: str) -> np.ndarray | None:
        """The value of an initializer or a Constant node's output (through Identity and Transpose), else None."""
        if name in self._const_cache:
            return self._const_cache[name]
        value = None
        if name in self.initializers:
            value = onnx_io.to_array(self.initializers[name])
        elif name in self.producer:
            node = self.producer[name]
            if node.op_type == "Constant":
                attr = node.attribute[0]
                value = (onnx_io.to_array(attr.t) if attr.name == "value" else
                         np.asarray(onnx.helper.get_attribute_value(attr)))
            elif node.op_type == "Identity":
                value = self.constant(node.input[0])
            elif node.op_type == "Transpose":  # a tied embedding gathered from the LM head's weight: a view, no copy
                inner = self.constant(node.input[0])
                value = None if inner is None else np.transpose(inner, self.attr(node, "perm"))
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

    def symbolic_shape(self, name: str) -> list[int | str] | None:
        """Dims from ONNX Runtime's symbolic shape inference (``onnxruntime.tools.symbolic_shape_infer``): unlike
        onnx's, it proves symbolic dims equal across ops (the ``seq`` read off q by a Shape and the ``seq`` of the
        attention output get one name). Run once, on the skeleton, on first use; None where it has no answer."""
        if self._symbolic is None:
            self._symbolic = {}
            try:
                SymbolicShapeInference = _symbolic_shape_infer().SymbolicShapeInference

                surrogate = onnx_io.skeleton(self.model)
                for node in surrogate.graph.node:  # ops it has no rule for, where output 0 has input 0's shape
                    if (node.domain or "", node.op_type) in SYMBOLIC_STAND_INS:
                        del node.output[1:], node.input[1:], node.attribute[:]
                        node.op_type, node.domain = "Identity", ""
                inferred = SymbolicShapeInference.infer_shapes(surrogate, auto_merge=True)
            except Exception:  # noqa: BLE001 - a help where it works (it knows no custom op), never a requirement
                inferred = None
            for info in (*inferred.graph.value_info, *inferred.graph.output) if inferred is not None else ():
                if info.type.tensor_type.HasField("shape"):
                    self._symbolic[info.name] = [d.dim_param if d.HasField("dim_param") else
                                                 d.dim_value if d.HasField("dim_value") else None
                                                 for d in info.type.tensor_type.shape.dim]
        dims = self._symbolic.get(name)
        return None if dims is None or None in dims or "" in dims else dims

    def same_shape(self, a: str, b: str) -> bool:
        """Whether tensors ``a`` and ``b`` provably have the same shape (static dims, or symbolic dims that
        ``symbolic_shape`` proves equal)."""
        static_a, static_b = self.static_shape(a), self.static_shape(b)
        if static_a is not None and None not in static_a and static_a == static_b:
            return True
        sym_a, sym_b = self.symbolic_shape(a), self.symbolic_shape(b)
        return sym_a is not None and sym_a == sym_b

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

    def ancestors(self, tensors, stop: set[str] = frozenset(), shapes: bool = False) -> set[str]:
        """Tensors ``tensors`` are computed from, over data edges (``shapes``: over Shape edges too)."""
        seen, todo = set(), deque(tensors)
        while todo:
            t = todo.popleft()
            if t in seen:
                continue
            seen.add(t)
            if t in stop or t not in self.producer:
                continue
            node = self.producer[t]
            todo.extend([i for i in node.input if i] if shapes else self.data_inputs(node))
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

    def depends_on_inputs(self, tensor: str, shapes: bool = False) -> set[str]:
        """Graph inputs the value of ``tensor`` depends on (``shapes``: also those whose shape it reads)."""
        return self.ancestors([tensor], shapes=shapes) & set(self.graph_inputs)

    # ---- evaluation ---------------------------------------------------------------------------------
    def evaluate(self, outputs: list[str], feeds: dict[str, np.ndarray], step: "ProbeStep") -> list[np.ndarray]:
        """Run the part of the graph that computes ``outputs`` from ``feeds`` (internal tensors allowed)
        and the graph inputs as ``step`` sets them, in ONNX Runtime on the CPU."""
        import onnxruntime as ort

        from pagedkv.builder.precision import emulate_in_float32

        key = (tuple(outputs), tuple(sorted(feeds)))
        if key not in self._sessions:
            model, shape_feeds = self._extract(outputs, feeds, step)
            model = emulate_in_float32(model)  # 16-bit graphs: float32 math, each result rounded (no bf16 CPU kernels)
            options = ort.SessionOptions()
            options.log_severity_level = 4  # a sin/cos table too short for a probe is expected, not news
            self._sessions[key] = (onnx_io.ort_session(model, options), shape_feeds)
        session, shape_feeds = self._sessions[key]
        names = {i.name for i in session.get_inputs()}
        wide = {i.name for i in session.get_inputs() if i.type == "tensor(float)"}
        inputs = {k: np.asarray(v, np.float32) if k in wide else v for k, v in feeds.items()}
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
INPUT_ROLES = ("input_ids", "attention_mask", "position_ids", "past_key", "past_value", "passthrough")


@dataclass
class ProbeStep:
    """Concrete graph inputs for an evaluation: ``batch`` sequences with ``past`` cached tokens and ``seq``
    new ones at positions past..past+seq-1 (or at ``positions``, one per new token), no padding. Past tensors
    are only ever fed as shapes."""

    roles: dict[str, str]  # graph input -> role (INPUT_ROLES)
    past_shape: dict[str, tuple[int, int]]  # past input -> (kv_heads, head_dim)
    batch: int = 1
    past: int = 0
    seq: int = 1
    int_types: dict[str, np.dtype] = field(default_factory=dict)
    positions: tuple[int, ...] | None = None  # position_ids of the new tokens (None: past..past+seq-1)

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
            positions = np.arange(self.past, self.past + self.seq) if self.positions is None else self.positions
            return np.broadcast_to(np.asarray(positions), self.shape(name)).astype(dtype)
        if role == "input_ids":
            return np.zeros(self.shape(name), dtype=dtype)
        return np.zeros(self.shape(name), dtype=np.float32)

    def at(self, batch: int, past: int, seq: int, positions=None) -> "ProbeStep":
        if positions is not None and len(positions) != seq:
            raise ValueError(f"positions: expected {seq} (one per new token), got {len(positions)}")
        return ProbeStep(self.roles, self.past_shape, batch, past, seq, self.int_types,
                         None if positions is None else tuple(int(p) for p in positions))
