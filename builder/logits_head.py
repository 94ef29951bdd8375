"""The heads on top of a rewritten decoder: logits only for the rows that need them, and sampling on the device.

Both are emitted by the rewrite (``pagedkv.builder.rewrite``, through its emitter) with standard ONNX ops only, so
ONNX Runtime, TensorRT and the CUDA-kernel backend run the same graph. The engine tensors are
``pagedkv.engine_io``'s (``logits_rows``, ``sampling_params``, ``penalty_tokens``, ``penalty_counts`` ->
``logits``, ``next_tokens``, ``next_logprobs``, ``top_tokens``, ``top_logprobs``); the float64 numpy spec of the
sampling head is ``pagedkv.reference.sampling``.

**Rows** (always): the LM head's input ``[1, T, hidden]`` is gathered at ``logits_rows`` (``Gather`` axis 1)
before the LM-head MatMul, so a decode step of B sequences computes B rows of logits, not T. The LM head is
found by structure: from the ``logits`` output back through element-wise ops with constant operands (a bias,
a soft-cap, a Cast) to a ``MatMul``/``Gemm`` whose weight is a constant. When the graph has no such head the
gather goes on the logits themselves (same values, no saving) and the report says so.

**Sampling** (``RewriteOptions.sampling``): per row r, in float32 (``sampling_params`` columns ``SAMPLING_*``)::

    x        = logits[r]                                        (cast to float32)
    penalties: for each distinct token t of penalty_tokens[r] (prompt and output; -1 padding is ignored)
               x[t] = x[t] / rep if x[t] > 0 else x[t] * rep;  x[t] -= presence * (count > 0) + frequency * count
    greedy   = argmax x                                         (temperature <= 0)
    xs       = x / temperature
    vals     = the K = min(candidates, vocab) largest xs, sorted (TopK)
    top-k    : keep vals[:k] (k = 0 or k >= K: off)
    top-p    : keep the shortest prefix of vals whose probability mass reaches top_p (renormalized over the
               top-k set when top-k is on, over the whole vocabulary otherwise)
    min-p    : keep xs >= max(xs) + log(min_p)
    sample   = inverse CDF of softmax(xs) restricted to the kept tokens at the row's uniform u

The truncations become one threshold on xs (tokens equal to it are kept). top-k and top-p look at the K
candidates only: exact whenever k <= K and the nucleus lies within them (K = vocab makes them exact always;
TensorRT's TopK allows K <= 3840). Pure temperature sampling and min-p see the whole vocabulary. The inverse
CDF is two-level — chunk sums of ~sqrt(vocab) tokens, then one chunk — so no full-vocabulary prefix sum is
needed. Logprobs are of the raw model distribution: the chosen token's and the N best (``top_logprobs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from pagedkv import engine_io

_FP32 = np.float32
PREFIX = "/pagedkv/logits_head"  # names of the heads' nodes and tensors
# The sampling head's nodes: float32 as written; a rewrite --dtype keeps them so (pagedkv.builder.precision).
SAMPLING_PREFIX = PREFIX + "/sampling"
_MATMUL_OPS = ("MatMul", "Gemm")
# Ops the LM-head walk may pass between the head's MatMul and the logits output (one non-constant input each).
_ELEMENTWISE_OPS = ("Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Identity")


@dataclass(frozen=True)
class HeadReport:
    """Where the rows gather went (``"lm_head <node>"`` or ``"logits"``) and what the sampling head holds."""

    rows_gathered_at: str
    sampling: bool
    candidates: int  # K of the top-k / top-p candidates (0 without sampling)
    top_logprobs: int  # N (0 without sampling)

    def __str__(self) -> str:
        text = f"logits rows gathered before {self.rows_gathered_at}"
        if self.sampling:
            text += f"; sampling head: {self.candidates} top-k/top-p candidates, {self.top_logprobs} top logprobs"
        return text


def _lm_head_input(logits: gs.Variable) -> tuple[gs.Variable, gs.Node] | None:
    """The ``[1, T, hidden]`` input of the LM-head MatMul that produces ``logits``, or None."""
    t = logits
    for _ in range(8):
        if len(t.inputs) != 1:
            return None
        node = t.inputs[0]
        variable = [i for i in node.inputs if not isinstance(i, gs.Constant)]
        if node.op in _MATMUL_OPS:
            if len(node.inputs) >= 2 and isinstance(node.inputs[1], gs.Constant) and len(variable) == 1 \
                    and variable[0] is node.inputs[0] and node.attrs.get("transA", 0) == 0:
                return node.inputs[0], node
            return None
        if node.op not in _ELEMENTWISE_OPS or len(variable) != 1:
            return None
        t = variable[0]
    return None


def attach(em, engine: dict[str, gs.Variable], *, vocab: int, sampling: bool, candidates: int,
           top_logprobs: int) -> HeadReport:
    """Gather the LM head's rows at ``engine["logits_rows"]`` and, with ``sampling``, append the sampling head
    reading ``engine``'s sampling inputs. ``em`` is the rewrite's emitter (``graph``, ``var``, ``const``,
    ``node``); the graph's outputs become ``logits``, the sampling outputs, then the rest."""
    graph = em.graph
    logits = next((t for t in graph.outputs if t.name == engine_io.LOGITS), None)
    if logits is None:
        raise ValueError(f"the graph has no `{engine_io.LOGITS}` output to put the heads on")
    rows = engine[engine_io.LOGITS_ROWS]
    found = _lm_head_input(logits)
    prefix = PREFIX
    if found is not None:
        hidden, node = found
        gathered = em.var(f"{prefix}/rows", hidden.dtype or em.dtype, None)
        em.node("Gather", [hidden, rows], [gathered], f"{prefix}/rows/Gather", axis=1)
        node.inputs[0] = gathered
        where = f"lm_head {node.name}"
    else:  # no recognizable LM head: select the rows of the logits themselves
        full = em.var(f"{prefix}/all_rows", logits.dtype, None)
        producer = logits.inputs[0]
        producer.outputs[producer.outputs.index(logits)] = full
        em.node("Gather", [full, rows], [logits], f"{prefix}/rows/Gather", axis=1)
        where = "logits (no LM-head MatMul found)"
    logits.shape = list(engine_io.resolve_shape(engine_io.SPECS[engine_io.LOGITS], {engine_io.VOCAB: vocab}))
    if not sampling:
        return HeadReport(where, False, 0, 0)
    k = min(int(candidates), vocab)
    n = min(int(top_logprobs), vocab)
    outputs = _SamplingHead(em, SAMPLING_PREFIX, vocab).emit(logits, engine, k, n)
    rest = [t for t in graph.outputs if t is not logits]
    graph.outputs = [logits, *outputs, *rest]
    return HeadReport(where, True, k, n)


class _SamplingHead:
    """Writes the sampling ops (module docstring) into the rewrite's emitter; all arithmetic in float32."""

    def __init__(self, em, prefix: str, vocab: int):
        self.em, self.prefix, self.vocab = em, prefix, vocab

    # ---- small op helpers ----------------------------------------------------------------------------
    def op(self, op: str, inputs, name: str, dtype=_FP32, **attrs) -> gs.Variable:
        out = self.em.var(f"{self.prefix}/{name}", dtype, None)
        self.em.node(op, inputs, [out], f"{self.prefix}/{name}/{op}", **attrs)
        return out

    def topk(self, x, k: int, name: str) -> tuple[gs.Variable, gs.Variable]:
        """The k largest entries of the last axis, sorted: (float32 values, int64 indices)."""
        values, indices = self.em.var(f"{self.prefix}/{name}", _FP32, None), \
            self.em.var(f"{self.prefix}/{name}_indices", np.int64, None)
        self.em.node("TopK", [x, self.const(f"{name}.k", [k])], [values, indices], f"{self.prefix}/{name}/TopK",
                     axis=-1, largest=1, sorted=1)
        return values, indices

    def const(self, name: str, value) -> gs.Constant:
        return self.em.const(f"{self.prefix}/{name}", np.asarray(value))

    def column(self, params, index: int, name: str):
        """sampling_params[:, index:index+1] -> [R, 1]."""
        return self.op("Slice", [params, self.const(f"{name}.start", [index]), self.const(f"{name}.end", [index + 1]),
                                 self.const(f"{name}.axes", [1])], name)

    def reduce_sum(self, x, name: str, keepdims: int = 1):
        return self.op("ReduceSum", [x, self.const(f"{name}.axes", [-1])], name, keepdims=keepdims)

    def last(self, x, name: str):
        """x[..., -1:] (keeps the axis)."""
        return self.op("Slice", [x, self.const(f"{name}.start", [-1]), self.const(f"{name}.end", [2 ** 31 - 1]),
                                 self.const(f"{name}.axes", [-1])], name)

    def as_float(self, x, name: str):
        return self.op("Cast", [x], name, to=onnx.TensorProto.FLOAT)

    def first_above(self, cum, target, weights, positions, name: str):
        """Index of the first entry of ``cum`` (a prefix sum of non-negative ``weights``) above ``target``,
        clamped to the last entry with a positive weight (float rounding at the top end). float32 [..., 1]."""
        count = self.reduce_sum(self.as_float(self.op("LessOrEqual", [cum, target], f"{name}/le", dtype=np.bool_),
                                              f"{name}/le_f"), f"{name}/count")
        positive = self.op("Greater", [weights, self.const(f"{name}.zero", _FP32(0))], f"{name}/pos", dtype=np.bool_)
        last = self.topk(self.op("Where", [positive, positions, self.const(f"{name}.none", _FP32(-1))],
                                 f"{name}/pos_index"), 1, f"{name}/last")[0]
        return self.op("Min", [count, last], name)

    # ---- the head ------------------------------------------------------------------------------------
    def emit(self, logits, engine: dict, candidates: int, top_n: int) -> list[gs.Variable]:
        V = self.vocab
        params = engine[engine_io.SAMPLING_PARAMS]
        x = self.op("Reshape", [self.as_float(logits, "logits_f"), self.const("rows.shape", [-1, V])], "x")
        raw = self.op("LogSoftmax", [x], "raw_logprobs", axis=-1)
        top_lp, top_ids = self.topk(raw, top_n, "top")

        x = self.penalties(x, params, engine[engine_io.PENALTY_TOKENS], engine[engine_io.PENALTY_COUNTS])
        greedy = self.op("ArgMax", [x], "greedy", dtype=np.int64, axis=-1, keepdims=1)
        temperature = self.column(params, engine_io.SAMPLING_TEMPERATURE, "temperature")
        is_greedy = self.op("LessOrEqual", [temperature, self.const("zero", _FP32(0))], "is_greedy", dtype=np.bool_)
        safe_t = self.op("Where", [is_greedy, self.const("one", _FP32(1)), temperature], "safe_temperature")
        xs = self.op("Div", [x, safe_t], "scaled")
        keep = self.truncation(xs, params, candidates)
        sampled = self.inverse_cdf(xs, keep, self.column(params, engine_io.SAMPLING_UNIFORM, "uniform"))
        chosen = self.op("Where", [is_greedy, greedy, sampled], "chosen", dtype=np.int64)  # [R, 1]

        axes = self.const("squeeze.axes", [1])
        next_tokens = self.em.var(engine_io.NEXT_TOKENS, np.int32, None)
        self.em.node("Cast", [self.op("Squeeze", [chosen, axes], "chosen_1d", dtype=np.int64)], [next_tokens],
                     f"{self.prefix}/next_tokens/Cast", to=onnx.TensorProto.INT32)
        next_lp = self.em.var(engine_io.NEXT_LOGPROBS, _FP32, None)
        self.em.node("Squeeze", [self.op("GatherElements", [raw, chosen], "chosen_logprob", axis=1), axes],
                     [next_lp], f"{self.prefix}/next_logprobs/Squeeze")
        top_tokens = self.em.var(engine_io.TOP_TOKENS, np.int32, None)
        self.em.node("Cast", [top_ids], [top_tokens], f"{self.prefix}/top_tokens/Cast", to=onnx.TensorProto.INT32)
        top_logprobs = self.em.var(engine_io.TOP_LOGPROBS, _FP32, None)
        self.em.node("Identity", [top_lp], [top_logprobs], f"{self.prefix}/top_logprobs/Identity")
        dims = {engine_io.NUM_TOP_LOGPROBS: top_n}
        for t in (next_tokens, next_lp, top_tokens, top_logprobs):
            t.shape = list(engine_io.resolve_shape(engine_io.SPECS[t.name], dims))
        return [next_tokens, next_lp, top_tokens, top_logprobs]

    def penalties(self, x, params, tokens, counts):
        """Repetition / presence / frequency penalties on the penalty tokens' logits (a padded column V takes
        the -1 entries, so every index is valid and distinct tokens never collide)."""
        V = self.vocab
        ids = self.op("Cast", [tokens], "pen_ids", dtype=np.int64, to=onnx.TensorProto.INT64)
        valid = self.op("GreaterOrEqual", [ids, self.const("pen_zero", np.int64(0))], "pen_valid", dtype=np.bool_)
        index = self.op("Where", [valid, ids, self.const("pen_pad", np.int64(V))], "pen_index", dtype=np.int64)
        pad_col = self.op("Mul", [self.column(params, engine_io.SAMPLING_TEMPERATURE, "pen_pad_src"),
                                  self.const("pen_pad_zero", _FP32(0))], "pen_pad_col")
        padded = self.op("Concat", [x, pad_col], "padded", axis=1)
        picked = self.op("GatherElements", [padded, index], "pen_logits", axis=1)
        rep = self.column(params, engine_io.SAMPLING_REPETITION, "repetition")
        positive = self.op("Greater", [picked, self.const("pen_pos_zero", _FP32(0))], "pen_positive", dtype=np.bool_)
        repeated = self.op("Where", [positive, self.op("Div", [picked, rep], "pen_div"),
                                     self.op("Mul", [picked, rep], "pen_mul")], "pen_rep")
        seen = self.as_float(self.op("Greater", [counts, self.const("pen_cnt_zero", _FP32(0))], "pen_seen",
                                     dtype=np.bool_), "pen_seen_f")
        presence = self.op("Mul", [seen, self.column(params, engine_io.SAMPLING_PRESENCE, "presence")], "pen_presence")
        frequency = self.op("Mul", [counts, self.column(params, engine_io.SAMPLING_FREQUENCY, "frequency")],
                            "pen_frequency")
        adjusted = self.op("Sub", [self.op("Sub", [repeated, presence], "pen_sub1"), frequency], "pen_adjusted")
        scattered = self.op("ScatterElements", [padded, index, adjusted], "pen_scatter", axis=1)
        return self.op("Slice", [scattered, self.const("pen_slice.start", [0]), self.const("pen_slice.end", [V]),
                                 self.const("pen_slice.axes", [1])], "penalized")

    def truncation(self, xs, params, K: int):
        """Boolean [R, V]: the tokens top-k, top-p and min-p keep (one threshold on xs)."""
        vals = self.topk(xs, K, "cand")[0]  # [R, K], sorted
        top = self.op("Slice", [vals, self.const("max.start", [0]), self.const("max.end", [1]),
                                self.const("max.axes", [1])], "max")
        positions = self.const("cand.positions", np.arange(K, dtype=_FP32)[None, :])
        top_k = self.column(params, engine_io.SAMPLING_TOP_K, "top_k")
        k_on = self.op("And", [self.op("Greater", [top_k, self.const("k_zero", _FP32(0))], "k_pos", dtype=np.bool_),
                               self.op("Less", [top_k, self.const("k_cap", _FP32(K))], "k_lt", dtype=np.bool_)],
                       "k_on", dtype=np.bool_)
        k_eff = self.op("Where", [k_on, top_k, self.const("k_all", _FP32(K))], "k_eff")
        in_k = self.op("Less", [positions, k_eff], "in_k", dtype=np.bool_)
        e = self.op("Exp", [self.op("Sub", [vals, top], "cand_shift")], "cand_exp")
        e_k = self.op("Mul", [e, self.as_float(in_k, "in_k_f")], "cand_exp_k")
        z_full = self.reduce_sum(self.op("Exp", [self.op("Sub", [xs, top], "all_shift")], "all_exp"), "z_full")
        z = self.op("Where", [k_on, self.reduce_sum(e_k, "z_k"), z_full], "z")
        p = self.op("Div", [e_k, z], "cand_p")
        before = self.op("Sub", [self.op("CumSum", [p, self.const("cand_cum.axis", np.int64(1))], "cand_cum"), p],
                         "mass_before")
        top_p = self.column(params, engine_io.SAMPLING_TOP_P, "top_p")
        p_on = self.op("Less", [top_p, self.const("p_one", _FP32(1))], "p_on", dtype=np.bool_)
        in_p = self.op("Or", [self.op("Less", [before, top_p], "in_p_mass", dtype=np.bool_),
                              self.op("Not", [p_on], "p_off", dtype=np.bool_)], "in_p", dtype=np.bool_)
        kept = self.reduce_sum(self.as_float(self.op("And", [in_p, in_k], "in_kp", dtype=np.bool_), "in_kp_f"), "kept")
        last = self.op("Sub", [self.op("Max", [kept, self.const("kept_min", _FP32(1))], "kept_1"),
                               self.const("kept_one", _FP32(1))], "kept_last")
        thr_kp = self.op("GatherElements", [vals, self.op("Cast", [last], "kept_last_i", dtype=np.int64,
                                                          to=onnx.TensorProto.INT64)], "thr_kp", axis=1)
        truncating = self.op("Or", [k_on, p_on], "truncating", dtype=np.bool_)
        thr_kp = self.op("Where", [truncating, thr_kp, self.const("no_thr", _FP32(-np.inf))], "thr_kp_on")
        min_p = self.column(params, engine_io.SAMPLING_MIN_P, "min_p")
        thr_min = self.op("Add", [top, self.op("Log", [min_p], "log_min_p")], "thr_min")
        threshold = self.op("Max", [thr_kp, thr_min], "threshold")
        return self.op("GreaterOrEqual", [xs, threshold], "keep", dtype=np.bool_)

    def inverse_cdf(self, xs, keep, u):
        """int64 [R, 1]: the kept token at the row's uniform u, by chunk sums then one chunk."""
        V = self.vocab
        C = max(1, math.isqrt(V - 1) + 1)  # chunk width ~ sqrt(V)
        NC = -(-V // C)
        top = self.topk(xs, 1, "cdf_max")[0]
        w = self.op("Mul", [self.op("Exp", [self.op("Sub", [xs, top], "cdf_shift")], "cdf_exp"),
                            self.as_float(keep, "keep_f")], "weights")  # [R, V]
        if NC * C > V:
            w = self.op("Pad", [w, self.const("cdf_pad", np.asarray([0, 0, 0, NC * C - V], np.int64))], "weights_pad")
        chunks = self.op("Reshape", [w, self.const("chunks.shape", [0, NC, C])], "chunks")  # [R, NC, C]
        sums = self.reduce_sum(chunks, "chunk_sums", keepdims=0)  # [R, NC]
        cum = self.op("CumSum", [sums, self.const("chunk_cum.axis", np.int64(1))], "chunk_cum")
        target = self.op("Mul", [u, self.last(cum, "total")], "target")
        chunk_pos = self.const("chunk.positions", np.arange(NC, dtype=_FP32)[None, :])
        ci = self.first_above(cum, target, sums, chunk_pos, "chunk_index")  # [R, 1]
        ci64 = self.op("Cast", [ci], "chunk_index_i", dtype=np.int64, to=onnx.TensorProto.INT64)
        before = self.op("Sub", [self.op("GatherElements", [cum, ci64], "cum_at", axis=1),
                                 self.op("GatherElements", [sums, ci64], "sum_at", axis=1)], "before_chunk")
        rest = self.op("Max", [self.op("Sub", [target, before], "rest_raw"), self.const("rest_min", _FP32(0))], "rest")
        index = self.op("Add", [self.op("Unsqueeze", [ci64, self.const("ci.axes", [2])], "ci3", dtype=np.int64),
                                self.const("ci.broadcast", np.zeros((1, 1, C), np.int64))], "ci_broadcast",
                        dtype=np.int64)  # [R, 1, C]
        chunk = self.op("Squeeze", [self.op("GatherElements", [chunks, index], "chunk3", axis=1),
                                    self.const("chunk.axes", [1])], "chunk")  # [R, C]
        inner = self.op("CumSum", [chunk, self.const("inner_cum.axis", np.int64(1))], "inner_cum")
        inner_pos = self.const("inner.positions", np.arange(C, dtype=_FP32)[None, :])
        j = self.first_above(inner, rest, chunk, inner_pos, "inner_index")
        token = self.op("Add", [self.op("Mul", [ci, self.const("chunk_width", _FP32(C))], "chunk_start"), j], "token_f")
        return self.op("Cast", [token], "sampled", dtype=np.int64, to=onnx.TensorProto.INT64)

