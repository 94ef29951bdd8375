"""Float dtypes of a graph: conversion to float16 / bfloat16 (or back to float32), the type check a strongly
typed TensorRT network needs, and float32 emulation of 16-bit graphs for ONNX Runtime on the CPU.

    model16, report = convert_float_dtype(model, "fp16")   # weights, activations, plugin I/O
    check_types(model16)                                   # every op's same-typed inputs agree, else DTypeError
    runnable = emulate_in_float32(model16)                 # float32 math, every 16-bit result rounded to its dtype

Conversion (``convert_float_dtype``; docs/builder.md, "dtypes"). Every float value is one of three kinds:

* **model**: computed from the model's activations (graph inputs, the embedding rows, everything after): in
  the target dtype D, with the weights it meets (rounded to nearest even; a weight beyond D's range is an
  error naming it; the float32 extremes masks use as "minus infinity" become D's extremes);
* **island**: computed in float32 because the model asks: ``Cast(to=FLOAT)`` of an activation (RMSNorm's
  ``x.float()``, softmax's ``dtype=float32``), and reductions (ReduceMean, ReduceSum, ...) with the elementwise
  ops that only feed them, also where the exporter dropped the model's cast (the dynamo exporter drops the no-op
  casts of a float32 model): a variance squares activations, and float16 ends at 65504. An op whose inputs are
  all island values stays in the island; the island ends (its values cast to D) where it meets a model value or
  a weight: in a float32 export the model's closing ``.to(input_dtype)`` is an invisible no-op, and that is where
  it stood (RMSNorm: ``weight * x.to(input_dtype)``);
* **exact**: computed from constants and integers only (positions, masks, rotary angles, shape arithmetic):
  computed as the source graph computes it (float32 from a float32 export: a position in float16 is inexact
  past 2048 and infinite past 65504), then cast to D by the first op that mixes it with model values.

Constants take the dtype of the op that reads them (converted in place, a renamed copy for a second dtype):
one-element constants (eps, exponents, scales) as PyTorch treats Python scalars, weights as the model reads them.
A constant read by data (an embedding ``Gather`` by token ids) is a model value, except a ``Where`` choosing
between constant tables (LongRoPE's short or long inverse frequencies by the step's length): exact.
``Cast(to=FLOAT16|BFLOAT16)`` (the model's own 16-bit dtype) becomes ``Cast(to=D)``; the plugin nodes'
activations (qkv, bias, q, attention output) are D.

**Kept float32** (``float32_prefixes``): nodes whose names start with one of the prefixes compute in float32 as
written (their constants stay float32, their inputs of another dtype are cast to it), and a float graph input that
only they read keeps its float32: the rewrite's sampling head (``pagedkv.builder.logits_head``), whose inputs
``sampling_params`` and ``penalty_counts`` are float32 in the engine-I/O contract (a float16 uniform or seed
column would be rounded) and whose arithmetic the head specifies in float32.

Which inputs and outputs must share a type is read from the ONNX schemas (``onnx.defs``: one type parameter,
one type), with Pow's exponent joined to its base (TensorRT's elementwise layers take one type); ops without a
schema (the pagedkv plugins, ONNX Runtime's fused ops) share one type over their float inputs and outputs.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from pagedkv import onnx_io
from pagedkv.builder.graph_view import SHAPE_PRESERVING_FOREIGN_OPS, RewriteError, describe, inferred_value_info
from pagedkv.config import ONNX_DOMAIN, WRITE_PLUGIN_NAME

FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
DTYPES = {"fp32": TensorProto.FLOAT, "float32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16,
          "float16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16, "bfloat16": TensorProto.BFLOAT16}
# Reductions accumulate: computed in float32 whatever the model dtype (rule 3)...
REDUCTIONS = {"ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum",
              "ReduceLogSumExp"}
# ...and so are these elementwise ops when every consumer of theirs is (x ** 2 of a variance).
STATISTIC_FEEDERS = {"Pow", "Mul", "Sub", "Add", "Div", "Abs", "Neg", "Sqrt", "Exp"}
# Ops whose outputs are values of their inputs (moved, selected, never computed): exact in any float format,
# so the bfloat16 emulation does not round after them.
SHAPE_ONLY_OPS = {"Shape", "Size"}  # their outputs carry no values of their inputs
DATA_MOVEMENT_OPS = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Gather",
                     "GatherElements", "GatherND", "Slice", "Split", "Concat", "Expand", "Tile", "Where", "Max",
                     "Min", "Relu", "Neg", "Abs", "ScatterND", "ScatterElements", "Pad", "Constant",
                     "ConstantOfShape"}


class DTypeError(RewriteError):
    """A graph cannot be converted, or its types disagree; the message names the node or tensor."""


def parse_dtype(value) -> int:
    """'fp16' / 'float16' / TensorProto.FLOAT16 ... -> the ONNX element type."""
    if isinstance(value, (int, np.integer)) and int(value) in FLOAT_TYPES:
        return int(value)
    try:
        return DTYPES[str(value).lower()]
    except KeyError:
        raise DTypeError(f"dtype: expected one of {', '.join(DTYPES)}, got {value!r}") from None


def dtype_name(elem_type: int) -> str:
    """numpy's name of an ONNX element type: 'float32', 'float16', 'bfloat16'."""
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor: graph inputs, initializers, Constant outputs and inferred values."""
    types = {}
    for vi in inferred_value_info(model):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            types[node.output[0]] = node.attribute[0].t.data_type
    return types


def model_dtype(model: onnx.ModelProto) -> int:
    """The float dtype of most weight elements (float32 when the graph has no float weights)."""
    count: Counter = Counter()
    for init in model.graph.initializer:
        if init.data_type in FLOAT_TYPES:
            count[init.data_type] += int(np.prod(init.dims)) if init.dims else 1
    return count.most_common(1)[0][0] if count else TensorProto.FLOAT


# ---- type groups: which inputs and outputs of a node must share a type ---------------------------------------
@dataclass
class _Group:
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    allowed: set[int] | None = None  # element types the schema allows (None: any)


def _schema(node: onnx.NodeProto, opsets: dict[str, int]):
    domain = node.domain or ""
    if domain in ("", "ai.onnx") and onnx.defs.has(node.op_type):
        return onnx.defs.get_schema(node.op_type, opsets.get("", opsets.get("ai.onnx", 1)), "")
    return None


_TYPE_STRS = {"tensor(float)": TensorProto.FLOAT, "tensor(float16)": TensorProto.FLOAT16,
              "tensor(bfloat16)": TensorProto.BFLOAT16}


def _allowed_types(schema, param: str) -> set[int] | None:
    """The float element types a schema's type parameter allows."""
    for c in schema.type_constraints:
        if c.type_param_str == param:
            return {_TYPE_STRS[t] for t in c.allowed_type_strs if t in _TYPE_STRS}
    return None


def type_groups(node: onnx.NodeProto, types: dict[str, int], opsets: dict[str, int]) -> list[_Group]:
    """The groups of ``node``'s float inputs / outputs (by index) that must have one element type."""
    def is_float(name):
        return bool(name) and types.get(name) in FLOAT_TYPES

    schema = _schema(node, opsets)
    if schema is None:  # plugin nodes and foreign fused ops: one type over the float I/O
        keep = SHAPE_PRESERVING_FOREIGN_OPS.get((node.domain or "", node.op_type))
        outs = [j for j, o in enumerate(node.output) if is_float(o) and (keep is None or j in keep)]
        group = _Group([i for i, x in enumerate(node.input) if is_float(x)], outs)
        return [group] if group.inputs or group.outputs else []
    by_param: dict[str, _Group] = {}

    def param(formals, index):
        if not formals:
            return None
        formal = formals[min(index, len(formals) - 1)]
        if index >= len(formals) and formal.option != onnx.defs.OpSchema.FormalParameterOption.Variadic:
            return None
        return formal.type_str

    for i, name in enumerate(node.input):
        p = param(schema.inputs, i)
        if p is not None and is_float(name):
            by_param.setdefault(p, _Group()).inputs.append(i)
    for j, name in enumerate(node.output):
        p = param(schema.outputs, j)
        if p is not None and is_float(name):
            by_param.setdefault(p, _Group()).outputs.append(j)
    if node.op_type == "Pow" and "T1" in by_param:  # TensorRT: one type for base and exponent
        by_param.setdefault("T", _Group()).inputs.extend(by_param.pop("T1").inputs)
    groups = []
    for p, group in by_param.items():
        if p.startswith(("tensor(", "seq(")):
            continue  # a fixed type: nothing to choose
        group.allowed = _allowed_types(schema, p) if node.op_type != "Pow" else None
        groups.append(group)
    return groups


# ---- conversion ----------------------------------------------------------------------------------------
@dataclass
class ConversionReport:
    source: str  # dtype names
    target: str
    weights: int = 0  # initializers / Constant tensors converted
    float32_nodes: list[str] = field(default_factory=list)  # "op|name" of nodes computing a float32 island
    exact_nodes: int = 0  # nodes computing from constants and integers only (positions, tables), kept as they are
    casts: int = 0  # Cast nodes inserted at island borders

    def __str__(self) -> str:
        ops = Counter(name.split("|")[0] for name in self.float32_nodes)
        islands = ", ".join(f"{n} {op}" for op, n in sorted(ops.items())) or "none"
        return (f"{self.source} -> {self.target}: {self.weights} weights converted, float32 islands of "
                f"{len(self.float32_nodes)} nodes ({islands}), {self.exact_nodes} constant/position nodes kept, "
                f"{self.casts} casts at the borders")


def _round_to(values: np.ndarray, target: int, name: str) -> np.ndarray:
    """``values`` in the numpy dtype of ``target``, rounded to nearest even (numpy / ml_dtypes casts); the float32
    extremes used as 'minus infinity' become the target's extremes, other values out of range are an error."""
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(target)
    values = np.asarray(values, dtype=np.float32)
    if target == TensorProto.FLOAT:
        return values
    import ml_dtypes

    top = float(ml_dtypes.finfo(np_dtype).max)
    finite = np.isfinite(values)
    big = finite & (np.abs(values) > top)
    sentinel = big & (np.abs(values) >= np.finfo(np.float32).max / 2)
    if np.any(big & ~sentinel):
        worst = float(np.max(np.abs(values[big & ~sentinel])))
        raise DTypeError(f"{name}: holds values up to {worst:.6g}, beyond {np_dtype.name}'s range (+-{top:.6g})"
                         + ("; bfloat16 has float32's range" if target == TensorProto.FLOAT16 else ""))
    values = np.where(sentinel, np.sign(values) * top, values)
    return values.astype(np_dtype)


# What a float value is, for the conversion: computed from the model's activations (it moves to the target),
# from them inside a float32 island, or from constants and integers only (positions, masks, tables: computed
# as the source graph computes them, adopted by the first op that mixes them with activations).
MODEL, ISLAND, EXACT = "model", "island", "exact"


class _Converter:
    def __init__(self, model: onnx.ModelProto, target: int, float32_prefixes: tuple[str, ...] = ()):
        self.model = model
        self.float32_prefixes = tuple(float32_prefixes)
        self.graph = model.graph
        self.target = target
        self.types = elem_types(model)
        self.opsets = {o.domain: o.version for o in model.opset_import}
        self.report = ConversionReport(dtype_name(model_dtype(model)), dtype_name(target))
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.graph.node:
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        self.outputs = {o.name for o in self.graph.output}
        self.names = {n for node in self.graph.node for n in (*node.input, *node.output)} | \
            {i.name for i in self.graph.input} | {t.name for t in self.graph.initializer}
        self.node_names = {node.name for node in self.graph.node}
        self.kind: dict[str, str] = {}  # float tensor -> MODEL | ISLAND | EXACT
        self.new: dict[str, int] = {}  # tensor -> element type after the conversion
        # float constants (initializers, Constant nodes): converted where their readers want them
        self.constants: dict[str, onnx.TensorProto] = {}
        self.wanted: dict[str, set[int]] = {}
        self._casts: dict[tuple[str, int], str] = {}
        self.value_dependent: set[str] = set()  # tensors whose values depend on graph inputs (not their shapes)

    def _setup(self) -> None:
        inits = {t.name for t in self.graph.initializer}
        for vi in self.graph.input:
            if vi.name not in inits:
                self.value_dependent.add(vi.name)
                readers = self.consumers.get(vi.name, [])
                if vi.type.tensor_type.elem_type == TensorProto.FLOAT and readers and all(
                        self._kept_float32(n) for n in readers):
                    self.new[vi.name], self.kind[vi.name] = TensorProto.FLOAT, ISLAND
                elif vi.type.tensor_type.elem_type in FLOAT_TYPES:
                    vi.type.tensor_type.elem_type = self.target
                    self.new[vi.name], self.kind[vi.name] = self.target, MODEL
        for init in self.graph.initializer:
            if init.data_type in FLOAT_TYPES:
                self.constants[init.name] = init
        for node in self.graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value" \
                    and node.attribute[0].t.data_type in FLOAT_TYPES:
                self.constants[node.output[0]] = node.attribute[0].t
            if node.op_type not in SHAPE_ONLY_OPS and any(i in self.value_dependent for i in node.input):
                self.value_dependent.update(o for o in node.output if o)
        for name, tensor in self.constants.items():
            self.kind[name], self.new[name] = EXACT, tensor.data_type

    def _kept_float32(self, node: onnx.NodeProto) -> bool:
        return bool(self.float32_prefixes) and node.name.startswith(self.float32_prefixes)

    def _float32_statistics(self) -> set[int]:
        """Nodes kept in float32 by rule 3: float reductions and the elementwise ops that only feed them."""
        forced = {id(n) for n in self.graph.node if n.op_type in REDUCTIONS and n.input
                  and self.types.get(n.input[0]) in FLOAT_TYPES}
        changed = True
        while changed:
            changed = False
            for node in self.graph.node:
                if id(node) in forced or node.op_type not in STATISTIC_FEEDERS:
                    continue
                outs = [o for o in node.output if o]
                readers = [r for o in outs for r in self.consumers.get(o, [])]
                if readers and not self.outputs & set(outs) and all(id(r) in forced for r in readers):
                    forced.add(id(node))
                    changed = True
        return forced

    def _is_scalar_constant(self, name: str) -> bool:
        return name in self.constants and int(np.prod(self.constants[name].dims)) == 1

    def _selects_tables(self, node, group: _Group) -> bool:
        """A Where choosing between constants by a data-dependent condition (LongRoPE's short or long inverse
        frequencies by the step's length): exact, like the position math it feeds, unless a constant holds a value
        beyond the target's range (a mask's 'minus infinity': only a converted constant clamps it) or the target
        is wider than the constants (a 16-bit graph back to float32: converting them loses nothing)."""
        if node.op_type != "Where" or not group.inputs:
            return False
        names = [node.input[i] for i in group.inputs]
        if not all(n in self.constants for n in names):
            return False
        import ml_dtypes

        target = onnx.helper.tensor_dtype_to_np_dtype(self.target)
        top = float(ml_dtypes.finfo(target).max)
        tables = [numpy_helper.to_array(self.constants[n]) for n in names]
        return all(t.dtype.itemsize >= target.itemsize and np.all(np.abs(t.astype(np.float64)) <= top)
                   for t in tables)

    def _decide(self, node, group: _Group, forced: bool) -> tuple[int, str]:
        """(element type, kind) of a type group (module docstring, rules 1-5)."""
        if node.domain == ONNX_DOMAIN:
            return self.target, MODEL  # the plugins' activations (capability: SUPPORTED_IO_DTYPES)
        kinds = {self.kind.get(node.input[i]) for i in group.inputs}
        weights = any(self.kind.get(node.input[i]) == EXACT and not self._is_scalar_constant(node.input[i])
                      for i in group.inputs)
        if forced:
            dtype, kind = TensorProto.FLOAT, ISLAND
        elif MODEL in kinds or (ISLAND in kinds and weights):  # an island ends where it meets a weight
            dtype, kind = self.target, MODEL
        elif ISLAND in kinds:
            dtype, kind = TensorProto.FLOAT, ISLAND
        elif any(i in self.value_dependent for i in node.input if self.types.get(i) not in FLOAT_TYPES) \
                and not self._selects_tables(node, group):
            dtype, kind = self.target, MODEL  # constants read by data (an embedding Gather): the model's weights
        else:  # constants and integers only: as the source computes it
            members = [node.input[i] for i in group.inputs] + [node.output[j] for j in group.outputs]
            dtype = next((t for t in (self.new.get(m, self.types.get(m)) for m in members) if t), self.target)
            kind = EXACT
        if group.allowed is not None and dtype not in group.allowed:
            if TensorProto.FLOAT not in group.allowed:
                raise DTypeError(f"{describe(node)}: takes no {dtype_name(dtype)} or float32 there")
            dtype = TensorProto.FLOAT  # e.g. LayerNormalization's Mean / InvStdDev outputs
        return dtype, kind

    def _cast(self, name: str, dtype: int, before: list) -> str:
        key = (name, dtype)
        if key not in self._casts:
            out = _unique(f"{name}.{dtype_name(dtype)}", self.names)
            node_name = _unique(f"{name}/Cast.{dtype_name(dtype)}", self.node_names)
            before.append(onnx.helper.make_node("Cast", [name], [out], name=node_name, to=dtype))
            self.new[out] = dtype
            self._casts[key] = out
            self.report.casts += 1
        return self._casts[key]

    def _node(self, node: onnx.NodeProto, forced: set[int], fixes: list) -> list[onnx.NodeProto]:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise DTypeError(f"{describe(node)}: has a subgraph; converting control flow is not supported")
        if node.op_type == "Constant":
            return [node]
        if node.op_type == "Cast":
            to, source = _attr(node, "to"), self.kind.get(node.input[0])
            if to == TensorProto.FLOAT:  # the model asks for float32
                self.kind[node.output[0]] = ISLAND if source in (MODEL, ISLAND) else EXACT
            elif to in FLOAT_TYPES:  # to the model's own 16-bit dtype: to the target
                to = self.target
                _set_attr(node, "to", to)
                self.kind[node.output[0]] = MODEL
            self.new[node.output[0]] = to
            return [node]
        before: list[onnx.NodeProto] = []
        keep_f32 = id(node) in forced
        for group in type_groups(node, self.types, self.opsets):
            dtype, kind = self._decide(node, group, keep_f32)
            for i in group.inputs:
                name = node.input[i]
                if name in self.constants:
                    self.wanted.setdefault(name, set()).add(dtype)
                    fixes.append((node, i, name, dtype))
                elif self.new.get(name, self.types.get(name)) != dtype:
                    node.input[i] = self._cast(name, dtype, before)
            for j in group.outputs:
                self.new[node.output[j]], self.kind[node.output[j]] = dtype, kind
            if group.outputs and self.target != TensorProto.FLOAT:
                if kind == ISLAND:
                    self.report.float32_nodes.append(f"{node.op_type}|{node.name}")
                elif kind == EXACT:
                    self.report.exact_nodes += 1
        return before + [node]

    def _place_constants(self, fixes: list) -> list[onnx.TensorProto]:
        """Each float constant in the dtype its readers want: converted in place to the first wanted (the target
        first, so weights keep their names), a renamed copy for each other dtype."""
        copies: dict[tuple[str, int], str] = {}
        extra = []
        for name, dtypes in self.wanted.items():
            tensor = self.constants[name]
            value = onnx_io.to_array(tensor)
            primary = self.target if self.target in dtypes else tensor.data_type if tensor.data_type in dtypes \
                else min(dtypes)
            for dtype in sorted(dtypes - {primary}):
                copy_name = _unique(f"{name}.{dtype_name(dtype)}", self.names)
                extra.append(numpy_helper.from_array(_round_to(value, dtype, name), copy_name))
                copies[(name, dtype)] = copy_name
            if primary != tensor.data_type:
                tensor.CopyFrom(numpy_helper.from_array(_round_to(value, primary, name), tensor.name))
                if int(np.prod(tensor.dims)) > 1:
                    self.report.weights += 1
            self.new[name] = primary
        for node, i, name, dtype in fixes:
            node.input[i] = copies.get((name, dtype), name)
        return extra

    def run(self) -> tuple[onnx.ModelProto, ConversionReport]:
        forced = self._float32_statistics() | {id(n) for n in self.graph.node if self._kept_float32(n)}
        self._setup()
        fixes: list = []
        nodes = [n for node in self.graph.node for n in self._node(node, forced, fixes)]
        extra = self._place_constants(fixes)
        read = {name for node in nodes for name in node.input} | self.outputs
        # constants whose every reader now takes a converted copy go (a Constant node is a node to TensorRT)
        nodes = [n for n in nodes if n.op_type != "Constant" or n.output[0] in read]
        inits = [t for t in self.graph.initializer if t.name in read] + extra
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        del self.graph.initializer[:]
        self.graph.initializer.extend(inits)
        for vi in (*self.graph.value_info, *self.graph.output):
            t = self.new.get(vi.name)
            if t is not None and vi.type.tensor_type.elem_type in FLOAT_TYPES:
                vi.type.tensor_type.elem_type = t
        self.report.float32_nodes = sorted(set(self.report.float32_nodes))
        return self.model, self.report


def _unique(base: str, taken: set[str]) -> str:
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _set_attr(node: onnx.NodeProto, name: str, value) -> None:
    for a in node.attribute:
        if a.name == name:
            a.CopyFrom(onnx.helper.make_attribute(name, value))
            return
    node.attribute.append(onnx.helper.make_attribute(name, value))


def convert_float_dtype(model: onnx.ModelProto, dtype, float32_prefixes: tuple[str, ...] = ()) \
        -> tuple[onnx.ModelProto, ConversionReport]:
    """A copy of ``model`` computing in ``dtype`` ('fp16', 'bf16', 'fp32'), by the rules of the module docstring;
    nodes named with one of ``float32_prefixes`` (and the graph inputs only they read) stay float32. Raises
    DTypeError naming the node or tensor that cannot be converted."""
    return _Converter(copy.deepcopy(model), parse_dtype(dtype), float32_prefixes).run()


# ---- checking -----------------------------------------------------------------------------------------
def check_types(model: onnx.ModelProto) -> None:
    """Every node's inputs and outputs that share a type parameter have one element type (``type_groups``: the
    ONNX schemas, Pow's exponent with its base, one type over a plugin node's activations) — what a strongly
    typed TensorRT network requires. Raises DTypeError naming the node and the two tensors."""
    types = elem_types(model)
    opsets = {o.domain: o.version for o in model.opset_import}
    for node in model.graph.node:
        for group in type_groups(node, types, opsets):
            members = [(node.input[i], types[node.input[i]]) for i in group.inputs] + \
                      [(node.output[j], types[node.output[j]]) for j in group.outputs]
            first = members[0]
            for other in members[1:]:
                if other[1] != first[1]:
                    raise DTypeError(f"{describe(node)}: {first[0]!r} is {dtype_name(first[1])} but {other[0]!r} is "
                                     f"{dtype_name(other[1])}; they must have one type")


# ---- float32 emulation of bfloat16 ---------------------------------------------------------------------
def _declares_any(model: onnx.ModelProto, types) -> bool:
    """Whether any tensor of ``model`` is declared (inputs, outputs, value_info, initializers, Constant / Cast /
    ConstantOfShape attributes) with one of ``types``: without that, no value of the graph can have one."""
    g = model.graph
    if any(vi.type.tensor_type.elem_type in types for vi in (*g.input, *g.output, *g.value_info)):
        return True
    if any(t.data_type in types for t in g.initializer):
        return True
    for node in g.node:
        for a in node.attribute:
            if (a.type == onnx.AttributeProto.TENSOR and a.t.data_type in types) or (a.name == "to" and a.i in types):
                return True
    return False


def emulate_in_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose float16 / bfloat16 tensors are float32 holding the same values, for ONNX Runtime's
    CPU provider (no bfloat16 kernels; onnxruntime-extensions' Python ops take float32 only). Weights convert
    exactly: small constants in place, weights of ``onnx_io.EXTERNAL_MIN_BYTES`` or more through a ``Cast`` to
    float32 that ONNX Runtime folds when it loads the graph (they stay 16-bit, and on disk when they are there: a
    model of any size emulates without a float32 copy of its weights in the proto); every op with a 16-bit result
    computes it in float32 and rounds it to its dtype (``Cast`` there and back: round to nearest even), as an
    unfused 16-bit execution does; data-movement ops need no rounding, and the write plugin's q stays as the plugin
    op returns it (it feeds the attention plugin directly: the graph contract; the reference plugins compute in
    float64).
    A model without 16-bit tensors is returned as it is (not copied)."""
    narrow_types = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
    if not _declares_any(model, narrow_types):
        return model
    types = elem_types(model)
    out = copy.deepcopy(model)
    g = out.graph
    f32 = TensorProto.FLOAT

    def widen(tensor: onnx.TensorProto) -> None:
        if tensor.data_type in narrow_types:
            tensor.CopyFrom(numpy_helper.from_array(onnx_io.to_array(tensor).astype(np.float32), tensor.name))

    taken = {n for node in g.node for n in (*node.input, *node.output)} | {i.name for i in g.input} | \
        {t.name for t in g.initializer}
    node_names = {node.name for node in g.node}
    weights: dict[str, str] = {}  # a big 16-bit weight -> its float32 Cast
    nodes = []
    for init in g.initializer:
        if init.data_type in narrow_types and (onnx_io.is_external(init) or
                                               onnx_io.tensor_bytes(init) >= onnx_io.EXTERNAL_MIN_BYTES):
            weights[init.name] = _unique(f"{init.name}.float32", taken)
            nodes.append(onnx.helper.make_node("Cast", [init.name], [weights[init.name]], to=f32,
                                               name=_unique(f"{init.name}/Cast.float32", node_names)))
        else:
            widen(init)
    infos = {}
    for vi in (*g.input, *g.output, *g.value_info):
        infos[vi.name] = vi
        if vi.type.tensor_type.elem_type in narrow_types and vi.name not in weights:
            vi.type.tensor_type.elem_type = f32
    for node in g.node:
        node.input[:] = [weights.get(name, name) for name in node.input]
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                widen(a.t)
        if node.op_type == "Cast" and _attr(node, "to") in narrow_types:
            _set_attr(node, "to", f32)  # computed in float32, rounded below like any other result
        nodes.append(node)
        if node.op_type in DATA_MOVEMENT_OPS:
            continue
        for j, name in enumerate(node.output):
            dtype = types.get(name)
            if not name or dtype not in narrow_types or (node.domain == ONNX_DOMAIN and j == 0 and
                                                         node.op_type == WRITE_PLUGIN_NAME):
                continue  # the write plugin's q feeds the attention plugin directly (the graph contract)
            raw = _unique(f"{name}.float32", taken)
            narrow = _unique(f"{name}.{dtype_name(dtype)}", taken)
            node.output[j] = raw
            if name in infos:
                info = copy.deepcopy(infos[name])
                info.name = raw
                g.value_info.append(info)
            base = _unique(f"{node.name or name}/round_{dtype_name(dtype)}", node_names)
            nodes.append(onnx.helper.make_node("Cast", [raw], [narrow], name=base, to=dtype))
            nodes.append(onnx.helper.make_node("Cast", [narrow], [name], name=base + "/back", to=f32))
    del g.node[:]
    g.node.extend(nodes)
    return out
