"""A small ONNX graph builder for the synthetic generator: named nodes, constants and opset-aware helpers.

Node names follow the PyTorch exporter's scope style (``/layers.0/attn/MatMul_3``) so that the graphs read like
exported ones. The rewrite never looks at names; the tests use the ``/attn/``, ``/rotary/`` and ``/mask/``
scopes to tell which original nodes the rewrite may remove.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS_DOMAIN = "com.microsoft"


class GraphBuilder:
    def __init__(self, opset: int):
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.uses_ms_domain = False
        self._counter = itertools.count()
        self._scope = ""

    # ---- naming -------------------------------------------------------------------------------------
    def scope(self, scope: str) -> "GraphBuilder":
        self._scope = scope
        return self

    def _name(self, op: str) -> str:
        return f"{self._scope}/{op}_{next(self._counter)}"

    # ---- graph pieces -------------------------------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def const(self, value, name: str | None = None, dtype=None) -> str:
        """An initializer (weights, shapes, scalars)."""
        array = np.asarray(value, dtype=dtype) if dtype is not None else np.asarray(value)
        name = name or self._name("const")
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def i64(self, values) -> str:
        return self.const(np.asarray(values, dtype=np.int64))

    def f32(self, values) -> str:
        return self.const(np.asarray(values, dtype=np.float32))

    def op(self, op_type: str, inputs: list[str], num_outputs: int = 1, domain: str = "", outputs=None,
           **attrs):
        name = self._name(op_type)
        outs = outputs or [f"{name}_output_{i}" for i in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, domain=domain or None, **attrs))
        if domain == MS_DOMAIN:
            self.uses_ms_domain = True
        return outs[0] if len(outs) == 1 else outs

    # ---- opset-aware helpers ------------------------------------------------------------------------
    def reduce_mean_last(self, x: str) -> str:
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self.i64([-1])], keepdims=1)
        return self.op("ReduceMean", [x], axes=[-1], keepdims=1)

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        return self.op("Unsqueeze", [x, self.i64(axes)])

    def slice_last(self, x: str, start: int, end: int, step: int = 1) -> str:
        return self.op("Slice", [x, self.i64([start]), self.i64([end]), self.i64([-1]), self.i64([step])])

    def dim(self, x: str, index: int) -> str:
        """Dimension ``index`` of ``x`` as a 1-element int64 tensor (Shape -> Gather -> Unsqueeze)."""
        shape = self.op("Shape", [x])
        scalar = self.op("Gather", [shape, self.i64(index)], axis=0)
        return self.unsqueeze(scalar, [0])

    def model(self, name: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", self.opset)]
        if self.uses_ms_domain:
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="pagedkv.synthetic")
        model.ir_version = min(model.ir_version, 10)  # onnxruntime 1.18+ reads IR 10
        return model


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
INT32 = TensorProto.INT32
BOOL = TensorProto.BOOL
