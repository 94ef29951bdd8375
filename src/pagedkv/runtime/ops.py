"""The plugin ops inside ONNX Runtime: onnxruntime-extensions PyOps that forward to a runtime backend.

What onnxruntime-extensions' ``@onnx_op`` PyOp can and cannot do (checked with version 0.15), and how this
module works around each limit without touching the rewritten model on disk:

* **Domain**: a PyOp always lives in ``ai.onnx.contrib`` (``default_opset_domain()``); there is no domain
  argument. The session runs an in-memory copy whose plugin nodes are moved to that domain.
* **Arity**: one op type has one fixed input list. Our write node has 5-7 inputs (optional position_ids and
  bias), so each (plugin, io dtype, optional inputs) combination is registered as its own op type
  (``PagedKVQKVWrite__float32_pb`` ...), declared before any session that needs it is created.
* **Attributes**: every declared attribute must be present on the node, and values come back as Python
  int/float/str. Instead of re-declaring the plugin attribute set, the copy carries one INT attribute
  ``binding``: a key into this module's binding table, where the runtime stored the layer's parsed,
  validated ``WriteConfig`` / ``AttentionConfig`` and its backend.
* **Types**: inputs arrive as numpy arrays of the declared types (int64 ``kv_pools``, int32 metadata all
  work); several outputs are returned as a tuple (outputs travel back through Python lists: fine for a
  reference runtime, not a fast path).

The ``kv_pools`` address column: for host (numpy) pools it holds a handle from ``register_host_pool``
(never a real pointer); for device pools the real device address.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import onnx
from onnx import helper

from pagedkv.config import ATTENTION_PLUGIN_NAME, ONNX_DOMAIN, WRITE_PLUGIN_NAME

PYOP_DOMAIN = "ai.onnx.contrib"
# float32 only: onnxruntime-extensions 0.15 declares dt_float16 but aborts the process ("Type float16 not supported
# by python customops api") when a float16 PyOp runs. 16-bit graphs run emulated in float32
# (pagedkv.builder.precision.emulate_in_float32), as `compare` does.
_DTYPES = {"float32": "dt_float"}

_lock = threading.Lock()
_registered: set[str] = set()
_bindings: dict[int, object] = {}
_binding_ids = itertools.count(1)
_host_pools: dict[int, np.ndarray] = {}
_pool_handles = itertools.count(0x1000)  # far from 0, so a zeroed kv_pools row never resolves


# ---- host pools behind kv_pools handles ----------------------------------------------------------------
def register_host_pool(pool: np.ndarray) -> int:
    """A handle for the ``kv_pools`` address column that the reference ops resolve to ``pool``."""
    with _lock:
        handle = next(_pool_handles)
        _host_pools[handle] = pool
    return handle


def release_host_pool(handle: int) -> None:
    with _lock:
        _host_pools.pop(int(handle), None)


def resolve_host_pool(kv_pools: np.ndarray, pool_index: int) -> np.ndarray:
    """The numpy pool of row ``pool_index`` of a ``kv_pools`` input; checks the row against the pool."""
    from pagedkv.step import POOL_DESC_ADDRESS, POOL_DESC_NUM_BLOCKS

    if kv_pools.ndim != 2 or not 0 <= pool_index < kv_pools.shape[0]:
        raise ValueError(f"kv_pools: shape {kv_pools.shape} has no row pool_index={pool_index}")
    handle = int(kv_pools[pool_index, POOL_DESC_ADDRESS])
    pool = _host_pools.get(handle)
    if pool is None:
        raise ValueError(f"kv_pools[{pool_index}]: address {handle:#x} is not a registered host pool handle")
    num_blocks = int(kv_pools[pool_index, POOL_DESC_NUM_BLOCKS])
    if num_blocks != pool.shape[0]:
        raise ValueError(f"kv_pools[{pool_index}]: num_blocks={num_blocks} but the pool holds {pool.shape[0]} blocks")
    return pool


# ---- bindings ----------------------------------------------------------------------------------------
def bind(target) -> int:
    """Store ``target`` (an object with ``write(...)`` / ``attention(...)``) and return its binding id."""
    with _lock:
        key = next(_binding_ids)
        _bindings[key] = target
    return key


def unbind(key: int) -> None:
    with _lock:
        _bindings.pop(int(key), None)


def _lookup(binding: int):
    target = _bindings.get(int(binding))
    if target is None:
        raise RuntimeError(f"pagedkv PyOp: binding {binding} is not registered (was the runtime closed?)")
    return target


# ---- op variants ---------------------------------------------------------------------------------------
def variant_name(plugin: str, io_dtype: str, explicit_positions: bool = False, has_bias: bool = False) -> str:
    if io_dtype not in _DTYPES:
        raise ValueError(f"io dtype: the reference runtime supports {sorted(_DTYPES)} activations, got {io_dtype!r} "
                         "(run a 16-bit graph through pagedkv.builder.precision.emulate_in_float32 first)")
    suffix = ("p" if explicit_positions else "") + ("b" if has_bias else "")
    return f"{plugin}__{io_dtype}" + (f"_{suffix}" if suffix else "")


def ensure_registered(plugin: str, io_dtype: str, explicit_positions: bool = False, has_bias: bool = False) -> str:
    """Declare the PyOp variant (once per process) and return its op type."""
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    name = variant_name(plugin, io_dtype, explicit_positions, has_bias)
    with _lock:
        if name in _registered:
            return name
        act = getattr(PyCustomOpDef, _DTYPES[io_dtype])
        i32, i64 = PyCustomOpDef.dt_int32, PyCustomOpDef.dt_int64
        meta = [i64, i32, i32, i32]  # kv_pools, block_table, cu_q_lens, past_lens
        if plugin == WRITE_PLUGIN_NAME:
            inputs = [act] + meta + ([i32] if explicit_positions else []) + ([act] if has_bias else [])
            outputs = [act, i32]

            def body(qkv, kv_pools, block_table, cu_q_lens, past_lens, *optional, binding):
                rest = list(optional)
                position_ids = rest.pop(0) if explicit_positions else None
                bias = rest.pop(0) if has_bias else None
                return _lookup(binding).write(qkv, kv_pools, block_table, cu_q_lens, past_lens, position_ids, bias)
        elif plugin == ATTENTION_PLUGIN_NAME:
            inputs = [act] + meta + [i32]
            outputs = [act]

            def body(q, kv_pools, block_table, cu_q_lens, past_lens, kv_write_status, *, binding):
                return _lookup(binding).attention(q, kv_pools, block_table, cu_q_lens, past_lens, kv_write_status)
        else:
            raise ValueError(f"plugin: expected {WRITE_PLUGIN_NAME} or {ATTENTION_PLUGIN_NAME}, got {plugin!r}")
        onnx_op(op_type=name, inputs=inputs, outputs=outputs, attrs={"binding": PyCustomOpDef.dt_int64})(body)
        _registered.add(name)
    return name


def session_model(model: onnx.ModelProto, node_bindings: dict[str, tuple[str, int]]) -> onnx.ModelProto:
    """Copy of ``model`` whose plugin nodes are PyOp variants: ``node_bindings[node name] = (op type, binding)``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    seen = set()
    for node in out.graph.node:
        if node.domain != ONNX_DOMAIN:
            continue
        if node.name not in node_bindings:
            raise ValueError(f"node {node.name} ({node.domain}::{node.op_type}) has no runtime binding")
        op_type, key = node_bindings[node.name]
        node.op_type = op_type
        node.domain = PYOP_DOMAIN
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("binding", int(key)))
        seen.add(node.name)
    if seen != set(node_bindings):
        raise ValueError(f"bindings for nodes not in the graph: {sorted(set(node_bindings) - seen)}")
    imports = [o for o in out.opset_import if o.domain not in (ONNX_DOMAIN, PYOP_DOMAIN)]
    del out.opset_import[:]
    out.opset_import.extend(imports + [helper.make_opsetid(PYOP_DOMAIN, 1)])
    return out
