"""Rewrite an exported decoder-with-past graph: every attention block becomes ``PagedKVQKVWrite`` +
``PagedKVAttention`` over the paged KV pools, everything else stays bit-identical.

    result = rewrite_model("model.onnx", RewriteOptions(page_size=16, cache_dtype="fp16"))
    onnx_io.save(result.model, "paged.onnx"); print(result.report)     # paged.onnx + paged.onnx.data

How (``docs/builder.md`` has the full story):

1. Anchor on the past-KV graph inputs: rank-4 inputs that enter a node producing a graph output (the present;
   ``patterns.find_kv_anchors``, each pattern knowing its ops' present slots).
2. A registered pattern (``patterns/``) recognizes the attention structure around that node and returns the
   q/k/v attention inputs, the attention output and what the structure says (heads, scale, mask, window).
3. q, k and v are traced back to their projection MatMuls (``projection.trace_projection``); RoPE, the mask
   window and the GQA head mapping are measured by running the graph's own ops (``measure.measure_*``).
4. On a copy: one packed QKV MatMul (or, when a q/k norm sits before RoPE, the kept q/k/v re-concatenated),
   the two plugin nodes, a Reshape into the o_proj; past/present, mask and RoPE plumbing become dead and are
   removed. ``dtype`` converts weights, activations and the plugin I/O (``pagedkv.builder.precision``); quantized
   caches take per-layer scales, given or calibrated on the input graph (``pagedkv.builder.calibrate``). The logits
   heads go on top (``logits_head``: the LM head computes only the ``logits_rows`` rows; the sampling head picks the
   next tokens on the device). Every plugin attribute is checked against the plugins' capability table
   (``pagedkv.config``), the result with ``onnx.checker``, strict shape inference and ``precision.check_types``
   before it is returned.

Any size: a model file is opened with ``pagedkv.onnx_io.load`` (weights stay on disk, read through memory maps
where a probe, the calibration or the packed QKV weight needs them), the result refers to the input's weights until
``onnx_io.save`` copies them into the output's own data file.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from pagedkv import engine_io, onnx_io
from pagedkv.builder import logits_head, patterns
from pagedkv.builder.calibrate import CalibrationError, CalibrationPlan, KVCalibration
from pagedkv.builder.graph_view import GraphView, NotADecoderError, ProbeStep, RewriteError, describe
from pagedkv.builder.measure import (CACHE_PROBE, _np_dtype, fit_rope_config, measure_cache_path, measure_guard,
                                     measure_mask, measure_rope, rope_from_tables)
from pagedkv.builder.precision import check_types, convert_float_dtype, dtype_name, parse_dtype
from pagedkv.builder.projection import find_projection, heads_colmap, layout_chain, trace_projection
from pagedkv.config import (ATTENTION_PLUGIN_NAME, ATTRIBUTE_RANGES, INT32_MAX, ONNX_DOMAIN, PLUGIN_VERSION,
                            SUPPORTED_IO_DTYPES, WRITE_PLUGIN_NAME, AttentionConfig, RopeConfig, RopeScaling,
                            RopeStyle, WriteConfig, check_attribute_values)
from pagedkv.engine_io import CU_Q_LENS, KV_POOLS, NUM_TOKENS, PAST_LENS, POSITION_IDS
from pagedkv.layout import CacheDType, KVLayout
from pagedkv.pool_group import PoolGroup
from pagedkv.runtime.graph import passthrough_state

__all__ = ["RewriteError", "RewriteOptions", "RewriteResult", "RewriteReport", "LayerReport", "rewrite_model",
           "add_rewrite_arguments", "options_from_args", "run_rewrite"]

POOL_GROUPING = ("auto", "single", "per_layer")

@dataclass(frozen=True)
class RewriteOptions:
    page_size: int = 16
    cache_dtype: CacheDType | str = CacheDType.FP16
    # Quantized caches (fp8, int8) need scales, x ~= stored * scale: one K and one V scale for every layer, or a
    # per-layer calibration (a KVCalibration, or a CalibrationPlan the rewrite runs on its input graph).
    k_scale: float | None = None
    v_scale: float | None = None
    calibration: KVCalibration | CalibrationPlan | None = None
    dtype: str | None = None  # weights and activations: None keeps the graph's; "fp16" | "bf16" | "fp32" converts
    window: int | None = None  # None: as found in the graph; 0: full causal; > 0: force this window
    max_blocks: int | None = None  # static block-table width (None: dynamic "max_blocks")
    pool_grouping: str = "auto"  # auto: one group per (kv heads, head dim, window); single; per_layer
    explicit_positions: bool | None = None  # None: only when nodes outside attention still read position_ids
    # Attention without RoPE: None accepts it when the positions reach the hidden state otherwise (a learned
    # absolute position embedding, GPT-2), and refuses it when nothing would tell positions apart; True always
    # refuses, False always accepts.
    require_rope: bool | None = None
    zero_v_tail: bool = True
    sampling: bool = True  # append the sampling head (logits_head); False: logits only
    sampling_candidates: int = 1024  # K of top-k / top-p (TensorRT's TopK allows <= 3840)
    top_logprobs: int = 20  # N best tokens reported per row (OpenAI's maximum)

    def __post_init__(self):
        object.__setattr__(self, "cache_dtype", CacheDType.parse(self.cache_dtype))
        check_attribute_values({"page_size": self.page_size})
        if self.pool_grouping not in POOL_GROUPING:
            raise ValueError(f"pool_grouping: expected one of {POOL_GROUPING}, got {self.pool_grouping!r}")
        if self.window is not None and not 0 <= self.window <= ATTRIBUTE_RANGES["window"][1]:
            raise ValueError(f"window: expected a value in [0, {ATTRIBUTE_RANGES['window'][1]}] or None, "
                             f"got {self.window}")
        if self.max_blocks is not None and not 0 < self.max_blocks <= INT32_MAX // self.page_size:
            raise ValueError(f"max_blocks: expected a value in [1, {INT32_MAX // self.page_size}] (max_blocks * "
                             f"page_size cache positions must fit int32), got {self.max_blocks}")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(parse_dtype(self.dtype)))
        given = [name for name in ("k_scale", "v_scale") if getattr(self, name) is not None]
        for name in given:
            check_attribute_values({name: getattr(self, name)})
        cache = self.cache_dtype.name.lower()
        if not self.cache_dtype.quantized:
            if given or self.calibration is not None:
                raise ValueError(f"{'/'.join(given) or 'calibration'}: only quantized caches (fp8, int8) take "
                                 f"scales; cache_dtype is {cache}")
        elif self.calibration is not None and given:
            raise ValueError(f"{'/'.join(given)}: give scales or a calibration, not both")
        elif self.calibration is None and len(given) < 2:
            raise ValueError(f"cache_dtype={cache}: a quantized cache needs K and V scales; calibrate them on the "
                             "original graph (--calibrate [--calib-data FILE]) or give --k-scale and --v-scale")
        for name in ("sampling_candidates", "top_logprobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclass
class LayerReport:
    """What the rewrite found for one attention layer (and the plugin configs it wrote)."""

    index: int
    pattern: str
    anchor: str  # the node that anchored the match
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    qkv_bias: bool
    fused_qkv: bool  # q, k, v came out of one projection MatMul
    qk_norm: bool
    window: int
    attention_sinks: int
    softmax_scale: float
    logit_softcap: float
    projection: str  # "packed": one new QKV MatMul, bias in the plugin; "kept": q/k/v kept and concatenated
    pool_group: int = -1
    write: WriteConfig | None = None
    attention: AttentionConfig | None = None


@dataclass
class RewriteReport:
    layers: list[LayerReport]
    explicit_positions: bool
    removed_inputs: list[str]
    removed_outputs: list[str]
    nodes_before: int
    nodes_after: int
    page_size: int = 16
    cache_dtype: str = "fp16"
    scales: str = ""  # quantized caches: where the per-layer scales (LayerReport.write.pool) came from
    calibration: KVCalibration | None = None
    dtype: str = "float32"  # of the weights, activations and plugin I/O
    conversion: str = ""  # what the dtype conversion did (empty: none asked)
    notes: list[str] = field(default_factory=list)
    heads: logits_head.HeadReport | None = None

    def __str__(self) -> str:
        lines = [f"rewrote {len(self.layers)} attention layer(s); nodes {self.nodes_before} -> {self.nodes_after}; "
                 f"positions {'explicit (position_ids input)' if self.explicit_positions else 'past_len + i'}",
                 f"  KV cache: page_size={self.page_size} cache_dtype={self.cache_dtype}"
                 + (f", scales {self.scales}" if self.scales else ""),
                 f"  activations: {self.dtype}" + (f" ({self.conversion})" if self.conversion else "")]
        for r in self.layers:
            rope_text = _rope_text(r.rope, r.head_dim)
            scales = (f" k_scale={r.write.pool.k_scale:.6g} v_scale={r.write.pool.v_scale:.6g}"
                      if self.scales and r.write is not None else "")
            lines.append(
                f"  layer {r.index} [{r.pattern} @ {r.anchor}] heads={r.num_heads} kv_heads={r.num_kv_heads} "
                f"head_dim={r.head_dim} rope=({rope_text}) bias={int(r.qkv_bias)} fused_qkv={int(r.fused_qkv)} "
                f"qk_norm={int(r.qk_norm)} window={r.window} sinks={r.attention_sinks} "
                f"scale={r.softmax_scale:.6g} softcap={r.logit_softcap:g} qkv={r.projection} "
                f"pool_group={r.pool_group}{scales}")
        if self.heads is not None:
            lines.append(f"  {self.heads}")
        lines.append(f"  removed inputs: {', '.join(self.removed_inputs)}")
        lines.append(f"  removed outputs: {', '.join(self.removed_outputs)}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _rope_text(rope: RopeConfig, head_dim: int) -> str:
    from pagedkv.reference.rope import attention_factor

    if rope.style == RopeStyle.NONE:
        return "none"
    text = f"{rope.style.name.lower()} dim={rope.rotary_dim or head_dim} theta={rope.theta:g}"
    if rope.scaling == RopeScaling.LONGROPE:
        text += f" longrope long past kv {rope.original_max_positions}"
    elif rope.scaling == RopeScaling.YARN:
        text += (f" yarn x{rope.factor:g} original={rope.original_max_positions} beta={rope.beta_fast:g}/"
                 f"{rope.beta_slow:g}{'' if rope.truncate else ' untruncated'}")
    elif rope.scaling:
        text += f" {rope.scaling.name.lower()} x{rope.factor:g}"
    factor = attention_factor(rope)
    return text + (f" attention_factor={factor:.6g}" if factor != 1.0 else "")


@dataclass
class RewriteResult:
    model: onnx.ModelProto
    report: RewriteReport
    pool_groups: list[PoolGroup] = field(default_factory=list)  # group g: kv_pools row g, block_table_{g}


# ---- analysis -------------------------------------------------------------------------------------------
def _input_roles(view: GraphView, matches) -> tuple[dict[str, str], dict, dict]:
    roles, past_shape = {}, {}
    for m in matches:
        for name, role in ((m.past_key, "past_key"), (m.past_value, "past_value")):
            roles[name] = role
            past_shape[name] = (m.num_kv_heads, m.head_dim)
    int_types = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
    ints = [n for n in view.graph_inputs if n not in roles and view.elem_type(n) in int_types
            and len(view.static_shape(n) or []) == 2]
    tables = {n: _gathered_tables(view, n) for n in ints}
    ids = [n for n in ints if tables[n]]
    if len(ids) > 1:  # a sin/cos table is gathered by position too: the token ids are what the layers read
        hidden = view.ancestors([find_projection(view, matches[0].q_end).input[0]])
        ids = [n for n in ids if n in hidden] if len([n for n in ids if n in hidden]) == 1 else ids
    if len(ids) > 1:  # and so is a learned position embedding (GPT-2's wpe): the token table has a row per logit
        vocab = {shape[-1] for o in view.graph_outputs if len(shape := view.static_shape(o) or []) == 3 and shape[-1]}
        by_vocab = [n for n in ids if set(tables[n]) & vocab]
        ids = by_vocab if len(by_vocab) == 1 else ids
    if len(ids) != 1:
        raise RewriteError(f"expected exactly one integer [batch, seq] graph input that indexes the embedding "
                           f"table (input_ids), found {ids}")
    roles[ids[0]] = "input_ids"
    for name in passthrough_state(view.graph):  # state passed through to outputs: dropped with them
        roles.setdefault(name, "passthrough")
    seq_dim = (view.dim_names(ids[0]) or [None, None])[1]
    for name in ints:
        if name in roles:
            continue
        dims = view.dim_names(name) or [None, None]
        if seq_dim is not None and dims[1] == seq_dim:
            roles[name] = "position_ids"
        elif seq_dim is not None and dims[1] is not None:
            roles[name] = "attention_mask"
        else:  # no axis names to compare: the conventional names are all that is left
            roles[name] = "attention_mask" if "mask" in name.lower() else "position_ids"
    types = {n: onnx.helper.tensor_dtype_to_np_dtype(view.elem_type(n)) for n in roles if n in ints or n in ids}
    return roles, past_shape, types


def _gathered_tables(view: GraphView, name: str) -> list[int]:
    """Rows of the constant 2-D tables that ``name`` indexes (a Gather's indices), directly or through reshapes
    and casts (GPT-2 views input_ids as [-1, seq] first)."""
    rows, todo = [], [name]
    while todo:
        t = todo.pop()
        for c in view.consumers.get(t, []):
            if c.op_type == "Gather" and c.input[1] == t:
                table = view.constant(c.input[0])
                if table is not None and table.ndim == 2:
                    rows.append(int(table.shape[0]))
            elif c.op_type in ("Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten") and c.input[0] == t:
                todo.append(c.output[0])
    return rows


@dataclass
class _LayerPlan:
    match: patterns.AttentionMatch
    chains: dict  # "q" | "k" | "v" -> ProjectionChain
    colmaps: dict  # "q" | "k" | "v" -> [heads, head_dim] projection columns
    report: LayerReport


def _analyze(view: GraphView, m: patterns.AttentionMatch, step: ProbeStep, index: int,
             options: RewriteOptions, positions: list[str]) -> _LayerPlan:
    """One layer's plan. ``positions``: the graph inputs in the position_ids role."""
    chains, colmaps = {}, {}
    offsets = {"q": 0, "k": m.num_heads * m.head_dim, "v": (m.num_heads + m.num_kv_heads) * m.head_dim}
    width = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    for name, end, heads in (("q", m.q_end, m.num_heads), ("k", m.k_end, m.num_kv_heads), ("v", m.v_end, m.num_kv_heads)):
        chain = trace_projection(view, end)
        layout_chain(view, chain)
        chains[name] = chain
        colmaps[name] = heads_colmap(chain, heads, m.head_dim, m.anchor,
                                     (offsets[name], width) if m.packed_qkv else None)
    if chains["v"].regions:
        region = chains["v"].regions[0]
        raise RewriteError(f"{describe(region.nodes[-1])}: expected V to come from its projection through layout "
                           f"ops only, found a {region.kind} region")
    if chains["v"].scale_after(None) != 1.0 or chains["k"].scale_after(None) != 1.0:
        raise RewriteError(f"{describe(m.anchor)}: K or V is scaled between its projection and the cache; the "
                           "cache would hold scaled values")
    ropes = {n: chains[n].region("rope") for n in ("q", "k")}
    if m.rope_tables is not None:
        if ropes["q"] or ropes["k"]:
            raise RewriteError(f"{describe(m.anchor)}: applies RoPE itself (do_rotary=1) but q/k arrive rotated")
        cos, sin, style = m.rope_tables
        rope = fit_rope_config(rope_from_tables(cos, sin, style), m.head_dim, describe(m.anchor))
    elif ropes["q"] is None and ropes["k"] is None:
        absolute = bool(set(positions) & view.ancestors([chains["q"].hidden]))  # position embeddings in the input
        if options.require_rope or (options.require_rope is None and not absolute):
            raise RewriteError(f"{describe(m.anchor)}: expected RoPE on q and k between the projections "
                               f"({chains['k'].matmul.name!r}) and attention, found none"
                               + ("" if absolute else " (and no position_ids reach the layer's input either: "
                                  "nothing would tell positions apart; --allow-no-rope accepts it)"))
        rope = RopeConfig(style=RopeStyle.NONE)
    elif ropes["q"] is None or ropes["k"] is None:
        missing = "q" if ropes["q"] is None else "k"
        raise RewriteError(f"{describe(m.anchor)}: expected RoPE on both q and k, {missing} ({chains[missing].end!r}) "
                           "has none")
    else:
        found = {}
        for n in ("q", "k"):
            region = ropes[n]
            position = {int(c): i for i, c in enumerate(region.layout.colmap.ravel())}
            heads_map = np.vectorize(position.__getitem__)(colmaps[n])
            found[n] = fit_rope_config(measure_rope(view, region, step, heads_map, chains[n]), m.head_dim,
                                       describe(region.nodes[-1]))
        if found["q"] != found["k"]:
            raise RewriteError(f"{describe(m.anchor)}: q and k use different RoPE: {found['q']} vs {found['k']}")
        rope = found["q"]
    rope = dataclasses.replace(rope, **{f.name: _as_attribute(getattr(rope, f.name)) for f in dataclasses.fields(rope)
                                        if isinstance(getattr(rope, f.name), (float, tuple))})
    hidden = {chains["q"].hidden: np.zeros((1, CACHE_PROBE[1], chains["q"].weight_matrix(view).shape[0]),
                                           _np_dtype(view.elem_type(chains["q"].hidden)))}
    for path in (m.k_path, m.v_path):
        if path is not None:
            measure_cache_path(view, path, m.num_kv_heads, m.num_heads, m.head_dim, step, m.anchor, hidden)
    for condition in m.guards:
        measure_guard(view, condition, step, m.anchor)
    window, sinks = m.window, m.sinks
    if window is None:
        found = measure_mask(view, m.mask, step, m.anchor, m.mask_true_visible)
        window, sinks = found.window, found.sinks
    if options.window is not None:
        window, sinks = options.window, (sinks if options.window else 0)
    head_norm = any(chains[n].region("head_norm") for n in ("q", "k"))
    hidden = {chains[n].hidden for n in chains}
    packed = not head_norm and len(hidden) == 1
    q_cut = None if packed else ropes["q"].input if ropes["q"] else chains["q"].end
    scale = m.scale * chains["q"].scale_after(q_cut) if q_cut != chains["q"].end else m.scale
    fused = len({chains[n].matmul.name or id(chains[n].matmul) for n in chains}) == 1
    report = LayerReport(
        index=index, pattern=m.pattern, anchor=m.anchor.name, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim, rope=rope, qkv_bias=any(chains[n].bias for n in chains), fused_qkv=fused,
        qk_norm=head_norm, window=int(window), attention_sinks=int(sinks), softmax_scale=_as_attribute(scale),
        logit_softcap=m.logit_softcap, projection="packed" if packed else "kept")
    return _LayerPlan(m, chains, colmaps, report)


def _as_attribute(value):
    """The value an ONNX FLOAT (FLOATS) attribute carries, float32: what the plugin will see and the report says."""
    if isinstance(value, tuple):
        return tuple(float(v) for v in np.float32(value))
    return float(np.float32(value))


def _layer_scales(plans: list[_LayerPlan], options: RewriteOptions, calibration: KVCalibration | None) \
        -> tuple[dict[int, float], dict[int, float]]:
    """K and V scale of every layer (by report index): the given ones, the calibration's, or 1.0 (16-bit caches)."""
    layers = [p.report.index for p in plans]
    if calibration is None:
        k = 1.0 if options.k_scale is None else options.k_scale
        v = 1.0 if options.v_scale is None else options.v_scale
        return {i: k for i in layers}, {i: v for i in layers}
    k_scales, v_scales = calibration.scales(options.cache_dtype)
    by_present = {present_key: i for i, (present_key, _) in enumerate(calibration.present)}
    k_out, v_out = {}, {}
    for plan in plans:
        i = by_present.get(plan.match.present_key)
        if i is None:
            raise RewriteError(f"calibration: no amax for layer {plan.report.index} (present output "
                               f"{plan.match.present_key!r}); it was calibrated on another graph")
        k_out[plan.report.index], v_out[plan.report.index] = _as_attribute(k_scales[i]), _as_attribute(v_scales[i])
    return k_out, v_out


def _pool_groups(plans: list[_LayerPlan], options: RewriteOptions,
                 calibration: KVCalibration | None = None) -> list[PoolGroup]:
    keys = {}
    for plan in plans:
        r = plan.report
        key = (r.num_kv_heads, r.head_dim, r.window, r.attention_sinks)
        if options.pool_grouping == "per_layer":
            key = (*key, r.index)
        elif options.pool_grouping == "single":
            if keys and key not in keys:
                first = next(iter(keys))
                raise RewriteError(f"pool_grouping=single: layer {r.index} has (kv_heads, head_dim, window, "
                                   f"attention_sinks)={key}, layer {keys[first][0]} has {first}")
        keys.setdefault(key, []).append(r.index)
    k_scales, v_scales = _layer_scales(plans, options, calibration)
    groups = []
    for g, ((kv_heads, head_dim, window, sinks, *_), layers) in enumerate(keys.items()):
        n = len(layers)
        try:
            groups.append(PoolGroup(f"group{g}", KVLayout(n, kv_heads, options.page_size, head_dim),
                                    options.cache_dtype, window=window, attention_sinks=sinks,
                                    k_scales=tuple(k_scales[i] for i in layers),
                                    v_scales=tuple(v_scales[i] for i in layers), layers=tuple(layers)))
        except ValueError as e:
            raise RewriteError(f"pool group {g} (layers {layers}): {e}") from None
    return groups


# ---- emission -------------------------------------------------------------------------------------------
class _Emitter:
    def __init__(self, model: onnx.ModelProto, view: GraphView, roles: dict[str, str]):
        self.graph = gs.import_onnx(model)
        self.view = view
        self.roles = roles
        self.tensors = self.graph.tensors()
        self.dtype = None
        self._names = set(self.tensors)

    def name(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    def var(self, base: str, dtype, shape) -> gs.Variable:
        return gs.Variable(self.name(base), dtype=dtype, shape=shape)

    def const(self, base: str, value: np.ndarray) -> gs.Constant:
        return gs.Constant(self.name(base), np.ascontiguousarray(value))

    def node(self, op: str, inputs, outputs, name: str, domain: str | None = None, **attrs) -> None:
        self.graph.nodes.append(gs.Node(op=op, name=self.name(name), inputs=list(inputs), outputs=list(outputs),
                                        attrs=attrs, domain=domain))

    def as_model_dtype(self, x: gs.Variable, elem_type: int | None, base: str) -> gs.Variable:
        """``x`` in the model's dtype (the plugins' I/O): a Cast when the graph computed it in another (GPT-J
        casts q and k to float32 before attention)."""
        if elem_type is None or onnx.helper.tensor_dtype_to_np_dtype(elem_type) == self.dtype:
            return x
        cast = self.var(f"{base}/model_dtype", self.dtype, x.shape)
        self.node("Cast", [x], [cast], f"{base}/Cast", to=onnx.helper.np_dtype_to_tensor_dtype(self.dtype))
        return cast

    def reshape(self, x, shape: list[int], base: str, out_shape) -> gs.Variable:
        out = self.var(base, x.dtype if x.dtype is not None else self.dtype, out_shape)
        self.node("Reshape", [x, self.const(base + ".shape", np.asarray(shape, dtype=np.int64))], [out], base + "/Reshape")
        return out

    # ---- per layer ----------------------------------------------------------------------------------
    def packed_qkv(self, plan: _LayerPlan, prefix: str):
        """-> ([T, (H + 2 KVH) D] tensor, bias constant or None)."""
        m, chains, colmaps = plan.match, plan.chains, plan.colmaps
        width = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
        if plan.report.projection == "packed":
            weights = {n: chains[n].weight_matrix(self.view) for n in chains}  # [hidden, N]
            columns = [colmaps[n].ravel() for n in ("q", "k", "v")]
            same = len({chains[n].weight for n in chains}) == 1 and not chains["q"].transposed_weight
            if same and np.array_equal(np.concatenate(columns), np.arange(weights["q"].shape[1])):
                weight = self.tensors[chains["q"].weight]  # already [q | k | v]: reuse the initializer
            else:
                weight = self.const(f"{prefix}.qkv_proj.weight", np.concatenate(
                    [weights[n][:, c] for n, c in zip(("q", "k", "v"), columns)], axis=1))
            bias = None
            if any(chains[n].bias for n in chains):
                parts = []
                for n, c in zip(("q", "k", "v"), columns):
                    values = chains[n].bias_values(self.view, weights[n].shape[1])
                    parts.append(values[c].astype(weights[n].dtype))
                bias = self.const(f"{prefix}.qkv_proj.bias", np.concatenate(parts))
            hidden = self.tensors[chains["q"].hidden]
            projected = self.var(f"{prefix}/qkv_proj/output", self.dtype, [1, NUM_TOKENS, width])
            self.node("MatMul", [hidden, weight], [projected], f"{prefix}/qkv_proj/MatMul")
            return self.reshape(projected, [-1, width], f"{prefix}/qkv", [NUM_TOKENS, width]), bias
        parts = []
        for n in ("q", "k", "v"):
            chain = chains[n]
            rope = chain.region("rope")
            cut, layout = (rope.input, rope.layout) if rope else (chain.end, chain.end_layout)
            x = self.as_model_dtype(self.tensors[cut], self.view.elem_type(cut), f"{prefix}/{n}")
            perm = layout.tokens_first()
            if perm != list(range(len(perm))):
                moved = self.var(f"{prefix}/{n}/tokens_first", self.dtype, None)
                self.node("Transpose", [x], [moved], f"{prefix}/{n}/Transpose", perm=perm)
                x = moved
            features = layout.colmap.size
            x = self.reshape(x, [-1, features], f"{prefix}/{n}/flat", [NUM_TOKENS, features])
            position = {int(c): i for i, c in enumerate(layout.colmap.ravel())}
            order = np.asarray([position[int(c)] for c in colmaps[n].ravel()], dtype=np.int64)
            if not np.array_equal(order, np.arange(order.size)):
                gathered = self.var(f"{prefix}/{n}/heads", self.dtype, [NUM_TOKENS, order.size])
                self.node("Gather", [x, self.const(f"{prefix}/{n}/heads.index", order)], [gathered],
                          f"{prefix}/{n}/Gather", axis=1)
                x = gathered
            parts.append(x)
        qkv = self.var(f"{prefix}/qkv", self.dtype, [NUM_TOKENS, width])
        self.node("Concat", parts, [qkv], f"{prefix}/qkv/Concat", axis=1)
        return qkv, None

    def layer(self, plan: _LayerPlan, g: int, group: PoolGroup, engine: dict, explicit: bool,
              options: RewriteOptions):
        m, r = plan.match, plan.report
        prefix = f"/pagedkv/layers.{r.index}"
        qkv, bias = self.packed_qkv(plan, prefix)
        pool = group.pool_config(group.layers.index(r.index), pool_index=g)
        try:
            write = WriteConfig(num_q_heads=m.num_heads, pool=pool, rope=r.rope, has_bias=bias is not None,
                                explicit_positions=explicit, zero_v_tail=options.zero_v_tail)
            attention = AttentionConfig(num_q_heads=m.num_heads, pool=pool, window=r.window,
                                        attention_sinks=r.attention_sinks, softmax_scale=r.softmax_scale,
                                        logit_softcap=r.logit_softcap)
        except ValueError as e:
            raise RewriteError(f"{describe(m.anchor)}: layer {r.index} cannot use the plugins: {e}") from None
        r.write, r.attention, r.pool_group = write, attention, g
        q_width = m.num_heads * m.head_dim
        q = self.var(f"{prefix}/q", self.dtype, [NUM_TOKENS, q_width])
        status = _engine_tensor(engine_io.status_name(r.index), engine_io.SPECS[engine_io.KV_WRITE_STATUS], {})
        inputs = [qkv, engine[KV_POOLS], engine[engine_io.block_table_name(g)], engine[CU_Q_LENS], engine[PAST_LENS]]
        if explicit:
            inputs.append(engine[POSITION_IDS])
        if bias is not None:
            inputs.append(bias)
        self.node(WRITE_PLUGIN_NAME, inputs, [q, status], f"{prefix}/{WRITE_PLUGIN_NAME}", domain=ONNX_DOMAIN,
                  **write.to_node_attributes())
        out = self.var(f"{prefix}/attn_out", self.dtype, [NUM_TOKENS, q_width])
        self.node(ATTENTION_PLUGIN_NAME, [q, *inputs[1:5], status], [out], f"{prefix}/{ATTENTION_PLUGIN_NAME}",
                  domain=ONNX_DOMAIN, **attention.to_node_attributes())
        # The o_proj input keeps its name, dtype and consumers: only its producer changes. It is [batch, seq, H*D],
        # or [batch * seq, H*D] when the tokens were flattened for a Gemm o_proj.
        merged = self.tensors[m.out]
        merged.inputs.clear()
        out_type = self.view.elem_type(m.out)
        merged_dtype = onnx.helper.tensor_dtype_to_np_dtype(out_type) if out_type else self.dtype
        reshaped = merged if merged_dtype == self.dtype else self.var(f"{prefix}/attn_out/merged", self.dtype, None)
        flat = len(self.view.static_shape(m.out) or [1, 1, 1]) == 2
        merged.dtype, merged.shape = merged_dtype, [NUM_TOKENS, q_width] if flat else [1, NUM_TOKENS, q_width]
        reshaped.shape = merged.shape
        shape = [-1, q_width] if flat else [1, -1, q_width]
        self.node("Reshape", [out, self.const(f"{prefix}/attn_out.shape", np.asarray(shape, np.int64))],
                  [reshaped], f"{prefix}/attn_out/Reshape")
        if reshaped is not merged:
            self.node("Cast", [reshaped], [merged], f"{prefix}/attn_out/Cast", to=out_type)
        return status


def _model_float(view: GraphView, plans: list[_LayerPlan]) -> np.dtype:
    """The model's float dtype, that of its projection weights: the plugins' activations are in it."""
    return np.dtype(view.constant(plans[0].chains["q"].weight).dtype)


def _engine_tensor(name: str, spec: engine_io.TensorSpec, dims: dict[str, int]) -> gs.Variable:
    """An engine input or output as ``pagedkv.engine_io`` describes it, the symbolic dims in ``dims`` fixed."""
    return gs.Variable(name, dtype=spec.dtype, shape=list(engine_io.resolve_shape(spec, dims)))


def _emit(model, view, plans, groups, roles, options, explicit: bool) -> tuple[gs.Graph, list, list, object]:
    em = _Emitter(model, view, roles)
    em.dtype = _model_float(view, plans)
    dims = {engine_io.NUM_POOL_GROUPS: len(groups)}
    if options.max_blocks:
        dims[engine_io.MAX_BLOCKS] = options.max_blocks
    # every engine input but input_ids, which the graph has (its shape is set below)
    engine = {name: _engine_tensor(name, spec, dims)
              for name, spec in engine_io.engine_inputs(len(groups), explicit, options.sampling)
              if name != engine_io.INPUT_IDS}
    old_inputs = {t.name: t for t in em.graph.inputs}
    position_role = [n for n, role in roles.items() if role == "position_ids"]
    if explicit:
        if POSITION_IDS in old_inputs and roles.get(POSITION_IDS) != "position_ids":
            raise RewriteError(f"graph input {POSITION_IDS!r} is not the positions input; cannot add the engine input")
        for name in position_role:  # the old input lives on for the nodes outside attention that read it
            old_inputs[name].name = em.name(f"{name}.int64_2d")
    group_of = {layer: g for g, group in enumerate(groups) for layer in group.layers}
    statuses = [em.layer(plan, group_of[plan.report.index], groups[group_of[plan.report.index]], engine, explicit,
                         options) for plan in plans]
    if explicit:
        for name in position_role:
            old = old_inputs[name]
            wide = em.var(f"{POSITION_IDS}.int64", np.int64, [NUM_TOKENS])
            em.node("Cast", [engine[POSITION_IDS]], [wide], "/pagedkv/position_ids/Cast", to=onnx.TensorProto.INT64)
            em.node("Unsqueeze", [wide, em.const("/pagedkv/position_ids.axes", np.asarray([0], dtype=np.int64))], [old],
                    "/pagedkv/position_ids/Unsqueeze")
    presents = {p for plan in plans for p in (plan.match.present_key, plan.match.present_value)}
    presents |= {o for outs in passthrough_state(view.graph).values() for o in outs}
    removed_outputs = [t.name for t in em.graph.outputs if t.name in presents]
    em.graph.outputs = [t for t in em.graph.outputs if t.name not in presents] + statuses
    replaced = {n for n, role in roles.items() if role != "input_ids"}
    kept_inputs = [t for t in em.graph.inputs if t.name not in replaced and t not in
                   [old_inputs.get(n) for n in position_role]]
    for t in kept_inputs:
        if roles.get(t.name) == "input_ids":
            t.shape = list(engine_io.SPECS[engine_io.INPUT_IDS].shape)
    em.graph.inputs = kept_inputs + list(engine.values())
    for t in em.graph.outputs:
        if t.shape is not None and len(t.shape) == 3 and t not in statuses:
            t.shape = [1, NUM_TOKENS, t.shape[2]]
    heads = logits_head.attach(em, engine, vocab=_vocab(em.graph), sampling=options.sampling,
                               candidates=options.sampling_candidates, top_logprobs=options.top_logprobs)
    em.graph.cleanup(remove_unused_graph_inputs=False).toposort()
    removed_inputs = [n for n in replaced if n in old_inputs]
    return em.graph, removed_inputs, removed_outputs, heads


def _vocab(graph: gs.Graph) -> int:
    logits = next((t for t in graph.outputs if t.name == engine_io.LOGITS), None)
    if logits is None or not logits.shape or not isinstance(logits.shape[-1], (int, np.integer)):
        raise RewriteError(f"the graph's `{engine_io.LOGITS}` output needs a static vocabulary dimension, has shape "
                           f"{None if logits is None else logits.shape}")
    return int(logits.shape[-1])


def _fold_shape_reads(graph: gs.Graph, reads: dict, roles: dict, past_shape: dict) -> None:
    """Removed inputs whose shape is still read (the dynamo exporter takes the batch size from any tensor
    that has it, a past input included): dims known in the packed graph become constants (batch 1, static
    head counts and sizes). Reads of other dims stay and are reported."""
    for name in list(reads):
        role = roles[name]
        if role in ("past_key", "past_value"):
            template = [1, past_shape[name][0], None, past_shape[name][1]]
        else:
            template = [1, None]
        for node in [n for n in graph.nodes if n.op == "Shape" and n.inputs and n.inputs[0].name == name]:
            start, end = node.attrs.get("start", 0), node.attrs.get("end", None)
            dims = template[start:end] if end is not None else template[start:]
            if None in dims:
                continue
            value = gs.Constant(node.outputs[0].name + ".packed", np.asarray(dims, dtype=np.int64))
            node.inputs.clear()  # (keeps the graph's use lists in sync)
            node.op, node.attrs = "Constant", {"value": value}
    graph.cleanup(remove_unused_graph_inputs=False).toposort()


def _still_read(graph: gs.Graph, names) -> dict[str, list[str]]:
    reads = {}
    for node in graph.nodes:
        for t in node.inputs:
            if t.name in names:
                reads.setdefault(t.name, []).append(f"{node.op} node {node.name!r}")
    return reads


def _finish(graph: gs.Graph, model: onnx.ModelProto, dtype: str | None) -> tuple[onnx.ModelProto, str]:
    """The exported, converted (``dtype``) and checked model, and what the conversion did."""
    out = gs.export_onnx(graph, do_type_check=True)
    opsets = [o for o in out.opset_import if o.domain != ONNX_DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend(opsets + [onnx.helper.make_opsetid(ONNX_DOMAIN, int(PLUGIN_VERSION))])
    out.ir_version = model.ir_version
    out.producer_name = model.producer_name
    out.producer_version = model.producer_version
    out.doc_string = (model.doc_string + "\n" if model.doc_string else "") + "rewritten by pagedkv.builder.rewrite"
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    conversion = ""
    if dtype is not None:
        out, report = convert_float_dtype(out, dtype, float32_prefixes=(logits_head.SAMPLING_PREFIX,))
        conversion = str(report)
    _check(out, model)
    return out, conversion


UNCHECKED_DOMAIN = "pagedkv.unchecked"


def _check(out: onnx.ModelProto, model: onnx.ModelProto) -> None:
    """onnx.checker, strict shape inference and the type check (``precision.check_types``: what a strongly typed
    TensorRT network needs) on the result's weightless skeleton (``onnx_io.skeleton``: any size; ``onnx_io.save``
    checks the written file, weights included, by path). Ops the input model already carried in the default domain
    that onnx has no schema for (ORT's transformer optimizer writes ``SimplifiedLayerNormalization`` there: ONNX
    Runtime registers it, onnx does not) are untouched by the rewrite: they are checked like custom ops."""
    foreign = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)}
    checked = onnx_io.skeleton(out)
    if foreign:
        for node in checked.graph.node:
            if node.domain in ("", "ai.onnx") and node.op_type in foreign:
                node.domain = UNCHECKED_DOMAIN
        checked.opset_import.append(onnx.helper.make_opsetid(UNCHECKED_DOMAIN, 1))
    onnx.checker.check_model(checked)
    onnx.shape_inference.infer_shapes(checked, strict_mode=True)
    check_types(checked)


REWRITE_STEPS = 4  # rewrite_model's steps (match, analyze, emit, finish); calibrating adds one


def rewrite_model(model: onnx.ModelProto | str | Path, options: RewriteOptions | None = None, *,
                  quiet: bool = False, step=None) -> RewriteResult:
    """Rewrite every attention layer into the pagedkv plugins. Raises RewriteError (CalibrationError when a
    calibration plan's prompts cannot be read), never returns a half-rewritten graph (the input model is not
    modified). ``model``: a path (``onnx_io.load``: any size) or a ``ModelProto``; the result refers to the input's
    external weights, ``onnx_io.save`` writes it. ``quiet``: no progress bar while calibrating. ``step``: called
    with the name of each step as it starts (``userio.phases``; REWRITE_STEPS of them, one more when calibrating)."""
    step = step or (lambda name: None)
    options = options or RewriteOptions()
    model = copy.deepcopy(model) if isinstance(model, onnx.ModelProto) else onnx_io.load(model)
    step("match the attention blocks")
    view = GraphView(model)
    anchors = patterns.find_kv_anchors(view)
    if not anchors:
        raise NotADecoderError("no past-KV input found: expected rank-4 graph inputs that enter a node (Concat or an "
                           "attention op) whose output is a graph output (the present)")
    matches = patterns.match_all(view, anchors)
    claimed = {a for m in matches for a in (m.past_key, m.past_value)}
    for anchor in anchors:
        if anchor.past not in claimed:
            raise RewriteError(f"{describe(anchor.node)}: past input {anchor.past!r} was not matched to an attention")
    order = {name: i for i, name in enumerate(view.graph_outputs)}
    matches.sort(key=lambda m: order[m.present_key])
    roles, past_shape, int_types = _input_roles(view, matches)
    probe = ProbeStep(roles, past_shape, int_types=int_types)
    positions = [n for n, role in roles.items() if role == "position_ids"]
    step(f"analyze {len(matches)} attention layers")
    plans = [_analyze(view, m, probe, i, options, positions) for i, m in enumerate(matches)]
    calibration = options.calibration
    if isinstance(calibration, CalibrationPlan):  # after the analysis: structural errors come first
        step("calibrate the K/V scales")
        calibration = calibration.run(model, quiet=quiet)
    step("emit the plugin nodes")
    groups = _pool_groups(plans, options, calibration)
    explicit = bool(options.explicit_positions)
    graph, removed_inputs, removed_outputs, heads = _emit(model, view, plans, groups, roles, options, explicit)
    reads = _still_read(graph, {n for n, role in roles.items() if role != "input_ids"})
    position_reads = {n for n in reads if roles[n] == "position_ids"}
    if position_reads and not explicit:
        if options.explicit_positions is False:
            raise RewriteError(f"explicit_positions=False, but nodes outside attention read position_ids: "
                               f"{reads[next(iter(position_reads))]}")
        explicit = True
        graph, removed_inputs, removed_outputs, heads = _emit(model, view, plans, groups, roles, options, explicit)
        reads = _still_read(graph, {n for n, role in roles.items() if role not in ("input_ids", "position_ids")})
    step("finish the graph" + (f" in {options.dtype}" if options.dtype else ""))
    _fold_shape_reads(graph, reads, roles, past_shape)
    reads = _still_read(graph, {n for n in reads if roles[n] != "position_ids" or not explicit})
    for name, readers in reads.items():
        if roles[name] != "position_ids":
            raise RewriteError(f"graph input {name!r} ({roles[name]}) is still read outside attention by "
                               f"{readers[:3]}: the packed graph cannot provide it")
    out, conversion = _finish(graph, model, options.dtype)
    io_dtype = options.dtype or _model_float(view, plans).name
    cache = options.cache_dtype
    scales = ""
    if cache.quantized:
        scales = (calibration.describe(cache) if calibration is not None else
                  f"given: k_scale={options.k_scale:g} v_scale={options.v_scale:g} for every layer")
    notes = [] if io_dtype in SUPPORTED_IO_DTYPES else [
        f"the plugin activations are {io_dtype}; the plugins take {' or '.join(SUPPORTED_IO_DTYPES)} (an engine "
        "build needs them): convert with --dtype fp16|bf16"]
    report = RewriteReport([p.report for p in plans], explicit, sorted(removed_inputs), removed_outputs,
                           len(model.graph.node), len(out.graph.node), page_size=options.page_size,
                           cache_dtype=cache.name.lower(), scales=scales, calibration=calibration, dtype=io_dtype,
                           conversion=conversion, notes=notes, heads=heads)
    return RewriteResult(out, report, groups)


# ---- `pagedkv rewrite` -----------------------------------------------------------------------------------
def add_rewrite_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    lo, hi = ATTRIBUTE_RANGES["page_size"]
    parser.add_argument("input", help="exported decoder-with-past ONNX model")
    parser.add_argument("-o", "--output", required=True, help="where to write the rewritten model")
    parser.add_argument("--page-size", type=int, default=16, help=f"tokens per KV page, {lo}..{hi} (default 16)")
    parser.add_argument("--cache-dtype", default="fp16", help="fp16 | bf16 | fp8 | int8 (default fp16)")
    parser.add_argument("--dtype", default=None, choices=["fp16", "bf16", "fp32"],
                        help="convert weights, activations and the plugin I/O (default: keep the graph's own; "
                             "TensorRT engines need fp16 or bf16)")
    scales = parser.add_argument_group("quantized caches (fp8, int8): per-layer K/V scales, x ~= stored * scale")
    scales.add_argument("--calibrate", action="store_true",
                        help="measure per-layer K/V amax on the input graph: scale = amax / 448 (fp8) or / 127 "
                             "(int8); prompts from --calib-data, else random token ids")
    scales.add_argument("--calib-data", default=None, metavar="FILE",
                        help="calibration prompts: JSON lines {\"input_ids\": [...]} (or {\"text\": ...}), or text "
                             "with one prompt per line (needs --tokenizer); implies --calibrate")
    scales.add_argument("--tokenizer", default=None, metavar="DIR", help="local tokenizer directory for text prompts")
    scales.add_argument("--calib-prompts", type=int, default=None, metavar="N",
                        help="random calibration prompts (default 8)")
    scales.add_argument("--calib-len", type=int, default=None, metavar="L",
                        help="tokens per random calibration prompt (default 128)")
    scales.add_argument("--k-scale", type=float, default=None, help="one K scale for every layer (instead of "
                                                                       "--calibrate)")
    scales.add_argument("--v-scale", type=float, default=None, help="one V scale for every layer")
    parser.add_argument("--window", type=int, default=None,
                        help="override the sliding window found in the graph (0: full causal)")
    parser.add_argument("--max-blocks", type=int, default=None, help="static block-table width (default dynamic)")
    parser.add_argument("--pool-grouping", choices=POOL_GROUPING, default="auto",
                        help="auto: one pool per (kv heads, head dim, window); single; per_layer")
    parser.add_argument("--explicit-positions", action=argparse.BooleanOptionalAction, default=None,
                        help="add a position_ids engine input (default: only when needed)")
    parser.add_argument("--allow-no-rope", action="store_true",
                        help="accept attention without RoPE even when no position_ids reach the layers (default: "
                             "only with absolute position embeddings)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-sampling", action="store_true",
                        help="no sampling head: the graph gives logits only (the runtime then samples on the host)")
    parser.add_argument("--sampling-candidates", type=int, default=1024,
                        help="top-k / top-p candidates of the sampling head (default 1024; TensorRT: <= 3840)")
    parser.add_argument("--top-logprobs", type=int, default=20, help="top logprobs reported per token (default 20)")
    return parser


def _calibration_from_args(args) -> CalibrationPlan | None:
    from pagedkv.userio import check_input_dir, check_input_file

    random_options = args.calib_prompts is not None or args.calib_len is not None
    if not (args.calibrate or args.calib_data is not None or random_options):
        if args.tokenizer is not None:
            raise ValueError("tokenizer: only used with --calib-data (text calibration prompts)")
        return None
    if args.calib_data is not None:
        if random_options:
            raise ValueError("calib-prompts/calib-len: set the random prompts; --calib-data gives the prompts")
        check_input_file(args.calib_data, "calib-data")
    if args.tokenizer is not None:
        check_input_dir(args.tokenizer, "tokenizer")
    return CalibrationPlan(data=args.calib_data, tokenizer=args.tokenizer,
                           **{k: v for k, v in (("num_prompts", args.calib_prompts), ("prompt_len", args.calib_len))
                              if v is not None})


def options_from_args(args: argparse.Namespace) -> RewriteOptions:
    return RewriteOptions(page_size=args.page_size, cache_dtype=args.cache_dtype, k_scale=args.k_scale,
                          v_scale=args.v_scale, calibration=_calibration_from_args(args), dtype=args.dtype,
                          window=args.window, max_blocks=args.max_blocks, pool_grouping=args.pool_grouping,
                          explicit_positions=args.explicit_positions,
                          require_rope=False if args.allow_no_rope else None, sampling=not args.no_sampling,
                          sampling_candidates=args.sampling_candidates, top_logprobs=args.top_logprobs)


def run_rewrite(args: argparse.Namespace) -> int:
    from pagedkv.runtime.graph import is_rewritten
    from pagedkv.userio import UsageError, check_input_file, check_output_path, option_error, phases, print_json

    source = check_input_file(args.input, "input")
    check_output_path(args.output, [source])
    try:
        options = options_from_args(args)
    except ValueError as exc:
        raise option_error(exc) from None
    quiet = getattr(args, "quiet", False)
    calibrating = isinstance(options.calibration, CalibrationPlan)
    # read + rewrite_model's steps + write
    with phases(2 + REWRITE_STEPS + int(calibrating), desc="pagedkv rewrite", quiet=quiet) as step:
        step(f"read {source.name}")
        if is_rewritten(onnx_io.load(source, "input")):
            raise UsageError(f"input: {str(source)!r} is already rewritten (it has the pagedkv plugin nodes); "
                             "rewrite the decoder-with-past graph it came from")
        try:  # from the path: rewrite_model loads it itself (a ModelProto would be copied first)
            result = rewrite_model(source, options, quiet=quiet, step=step)
        except CalibrationError as exc:
            raise UsageError(str(exc)) from None
        except NotADecoderError as exc:
            raise UsageError(f"input: {str(source)!r} is not a decoder-with-past LLM graph: {exc}") from None
        except RewriteError as exc:
            print(f"pagedkv rewrite: {exc}", file=sys.stderr)
            return 1
        step(f"write {Path(args.output).name}")
        path = onnx_io.save(result.model, args.output, inputs=[source])
    if args.json:
        pools = [{"group": g, "mode": g.mode, "block_bytes": g.block_bytes} for g in result.pool_groups]
        print_json({"output": str(path), "data": str(onnx_io.data_path(path)), "report": result.report,
                    "pools": pools})
    else:
        print(result.report)
        print(f"wrote {path} and {onnx_io.data_path(path).name}")
    return 0
