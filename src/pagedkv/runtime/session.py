"""The rewritten graph in ONNX Runtime (``OrtExecutor``) and the original graph on dense past KV (``DenseSession``).

``OrtExecutor`` (an ``pagedkv.runtime.executor.Executor``): the rewritten graph in ONNX Runtime, plugin ops
bound to a backend (``backends.py``: float64 references on numpy pools, or the CUDA kernels on device pools);
the sampling head and everything else outside attention are ONNX Runtime's own CPU kernels.

``DenseSession``: the original decoder-with-past graph, one sequence per run (batch 1, no padding), its
present K/V kept as the next step's past, with the executors' ``step(entries)`` API so that ``compare`` drives
both with one schedule. Running sequences one at a time keeps the original free of padding effects (fully
masked rows, pad position conventions), so each of its logits is the model's exact answer for that sequence;
batching is exercised where it matters, on the rewritten side, whose steps pack all sequences together.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import onnx

from pagedkv import onnx_io
from pagedkv.config import ATTENTION_PLUGIN_NAME, WRITE_PLUGIN_NAME
from pagedkv.layout import PageLayout
from pagedkv.runtime import ops
from pagedkv.runtime.backends import check_backend_available, make_backend
from pagedkv.runtime.executor import Executor, StepEntries
from pagedkv.runtime.graph import DecoderGraph, GraphError, RewrittenGraph


def _ort():
    import onnxruntime

    return onnxruntime


def _cpu_session(model, sess_options=None):
    """A CPU session over a model file or ``ModelProto`` of any size (``onnx_io.ort_session``)."""
    ort = _ort()
    so = sess_options or ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = int(os.environ.get("PAGEDKV_ORT_THREADS", "1"))
    return onnx_io.ort_session(model, so)


_NP_OF_ORT = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
              "tensor(float16)": np.float16, "tensor(double)": np.float64}


def _input_types(session) -> dict[str, type]:
    return {i.name: _NP_OF_ORT.get(i.type) for i in session.get_inputs()}


@dataclass
class _LayerOp:
    """One plugin node's binding: its parsed config and the backend that executes it."""

    backend: object
    config: object

    def write(self, *args):
        return self.backend.write(self.config, *args)

    def attention(self, *args):
        return self.backend.attention(self.config, *args)


class OrtExecutor(Executor):
    """The rewritten graph in ONNX Runtime on a backend ("reference": numpy pools + float64 references, "cuda":
    device pools + the CUDA kernels).

    Args:
        model: rewritten ``onnx.ModelProto`` or path.
        backend: "reference" or "cuda".
        num_blocks: blocks per pool group (one int, or one per group).
        manager_kwargs: extra ``KVCacheManager`` arguments (``host_blocks``, ``enable_prefix_reuse``,
            ``debug_validate``...).
    """

    def __init__(self, model, *, backend: str = "reference", num_blocks=512, manager_kwargs: dict | None = None):
        from pagedkv.kvcache.manager import KVCacheManager

        check_backend_available(backend)  # before any device allocation
        self.name = backend
        self.graph = RewrittenGraph.load(model)
        storage = "numpy" if backend == "reference" else "device"
        self.manager = KVCacheManager(self.graph.groups, num_blocks, storage=storage, **(manager_kwargs or {}))
        self._bindings: list[int] = []
        self.backend = None
        try:
            self.backend = make_backend(backend, self.manager)
            node_bindings = {}
            for layer in self.graph.layers:
                for node, plugin, cfg in ((layer.write_node, WRITE_PLUGIN_NAME, layer.write),
                                          (layer.attention_node, ATTENTION_PLUGIN_NAME, layer.attention)):
                    flags = (cfg.explicit_positions, cfg.has_bias) if plugin == WRITE_PLUGIN_NAME else (False, False)
                    op_type = ops.ensure_registered(plugin, layer.io_dtype, *flags)
                    key = ops.bind(_LayerOp(self.backend, cfg))
                    self._bindings.append(key)
                    node_bindings[node] = (op_type, key)
            from onnxruntime_extensions import get_library_path

            so = _ort().SessionOptions()
            so.register_custom_ops_library(get_library_path())
            model_copy = ops.session_model(self.graph.model, node_bindings)
            self.session = _cpu_session(model_copy, so)
        except BaseException:
            self.close()
            raise
        self._types = _input_types(self.session)

    def close(self) -> None:
        for key in self._bindings:
            ops.unbind(key)
        self._bindings = []
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        super().close()

    def kv_pools(self) -> np.ndarray:
        return self.backend.kv_pools()

    def _run(self, feed, outputs):
        feed = {k: np.ascontiguousarray(v, dtype=self._types.get(k) or v.dtype) for k, v in feed.items()}
        return dict(zip(outputs, self.session.run(outputs, feed)))

    def read_kv(self, seq_id, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized float64 K and V [kv_heads, length, head_dim] of a sequence's cached positions still
        resident (all positions for a full cache; a window's positions otherwise), read from the pool
        through the layout (reference backend only). Positions no longer resident are NaN."""
        from pagedkv.reference.quant import dequantize

        if self.manager.storage_kind != "numpy":
            raise RuntimeError("read_kv: only the reference backend keeps host pools")
        info = self.graph.layers[layer]
        pool_cfg = info.write.pool
        lay = pool_cfg.layout()
        g = pool_cfg.pool_index
        pool = self.manager.pool(g)
        length = self.manager.length(seq_id)
        row = self.manager.block_row(seq_id, g)
        block, offset, _ = lay.locate(row, np.arange(length), pool.shape[0])
        out = []
        for kv, scale in ((0, pool_cfg.k_scale), (1, pool_cfg.v_scale)):
            vals = np.full((lay.num_kv_heads, length, lay.head_dim), np.nan)
            ok = block >= 0
            for h in range(lay.num_kv_heads):
                if lay.page_layout == PageLayout.HND:  # [NB, L, 2, KVH, P, D]
                    stored = pool[block[ok], pool_cfg.layer_index, kv, h, offset[ok]]
                else:  # NHD: [NB, L, 2, P, KVH, D]
                    stored = pool[block[ok], pool_cfg.layer_index, kv, offset[ok], h]
                vals[h, ok] = dequantize(stored, pool_cfg.cache_dtype, scale)
            out.append(vals)
        return out[0], out[1]


class DenseSession:
    """The original decoder-with-past graph, one sequence per run, dense past K/V kept per sequence."""

    def __init__(self, model, head_dims=None):
        """``model``: the original graph's path (ONNX Runtime opens it and its data) or ``ModelProto``;
        ``head_dims``: per layer, for a graph whose past inputs leave the head dim symbolic."""
        self.graph = DecoderGraph.load(model)
        if head_dims is not None:
            self.graph = dataclasses.replace(self.graph, head_dims=tuple(int(d) for d in head_dims))
        if not all(self.graph.head_dims):
            raise GraphError(f"original graph: the head dim of its past inputs is symbolic "
                             f"(layers {[i for i, d in enumerate(self.graph.head_dims) if not d]}); pass head_dims")
        self.session = _cpu_session(model)
        self._types = _input_types(self.session)
        self._past: dict[object, list[np.ndarray]] = {}
        self._length: dict[object, int] = {}
        g = self.graph
        self._outputs = [g.logits] + [n for kv in g.present for n in kv]

    def has_sequence(self, seq_id) -> bool:
        return seq_id in self._past

    def free(self, seq_id) -> None:
        self._past.pop(seq_id, None)
        self._length.pop(seq_id, None)

    def present(self, seq_id, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V [kv_heads, length, head_dim] of a sequence (batch dim dropped)."""
        k, v = self._past[seq_id][2 * layer], self._past[seq_id][2 * layer + 1]
        return k[0], v[0]

    def step(self, entries: StepEntries) -> list[np.ndarray]:
        return [self._run_one(seq_id, np.asarray(tokens, dtype=np.int64)) for seq_id, tokens in entries]

    def _run_one(self, seq_id, tokens: np.ndarray) -> np.ndarray:
        g = self.graph
        dtype = np.dtype(g.past_dtype)
        if seq_id not in self._past:
            self._past[seq_id] = [np.zeros((1, g.kv_heads[i], 0, g.head_dims[i]), dtype=dtype)
                                  for i in range(g.num_layers) for _ in range(2)]
            self._length[seq_id] = 0
        past_len = self._length[seq_id]
        n = tokens.size
        feed = {g.input_ids: tokens[None, :]}
        if g.attention_mask:
            feed[g.attention_mask] = np.ones((1, past_len + n), dtype=np.int64)
        if g.position_ids:
            feed[g.position_ids] = np.arange(past_len, past_len + n, dtype=np.int64)[None, :]
        for (k, v), i in zip(g.past, range(g.num_layers)):
            feed[k], feed[v] = self._past[seq_id][2 * i], self._past[seq_id][2 * i + 1]
        for name, elem_type in g.passthrough:  # only passed through to outputs nobody reads: any value does
            feed[name] = np.zeros((), dtype=onnx.helper.tensor_dtype_to_np_dtype(elem_type))
        feed = {k: np.ascontiguousarray(a, dtype=self._types.get(k) or a.dtype) for k, a in feed.items()}
        logits, *present = self.session.run(self._outputs, feed)
        self._past[seq_id] = present
        self._length[seq_id] = past_len + n
        return logits.reshape(n, -1)
