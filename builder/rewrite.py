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
   removed. The result is checked with ``onnx.checker`` and shape inference before it is returned.

Any size: a model file is opened with ``pagedkv.onnx_io.load`` (weights stay on disk, read through memory maps
where a probe or the packed QKV weight needs them), the result refers to the input's weights until
``onnx_io.save`` copies them into the output's own data file.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from pagedkv import engine_io, onnx_io
from pagedkv.builder import patterns
from pagedkv.builder.graph_view import GraphView, ProbeStep, RewriteError, describe
from pagedkv.builder.measure import (CACHE_PROBE, _np_dtype, fit_rope_config, measure_cache_path, measure_guard,
                                     measure_mask, measure_rope, rope_from_tables)
from pagedkv.builder.projection import find_projection, heads_colmap, layout_chain, trace_projection
from pagedkv.config import (ATTENTION_PLUGIN_NAME, ONNX_DOMAIN, PLUGIN_VERSION, WRITE_PLUGIN_NAME,
                            AttentionConfig, RopeConfig, RopeStyle, WriteConfig)
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
    k_scale: float = 1.0
    v_scale: float = 1.0
    window: int | None = None  # None: as found in the graph; 0: full causal; > 0: force this window
    max_blocks: int | None = None  # static block-table width (None: dynamic "max_blocks")
    pool_grouping: str = "auto"  # auto: one group per (kv heads, head dim, window); single; per_layer
    explicit_positions: bool | None = None  # None: only when nodes outside attention still read position_ids
    require_rope: bool = True  # attention without RoPE is an error (every supported family has RoPE)
    zero_v_tail: bool = True

    def __post_init__(self):
        object.__setattr__(self, "cache_dtype", CacheDType.parse(self.cache_dtype))
        if self.page_size <= 0:
            raise ValueError(f"page_size: must be > 0, got {self.page_size}")
        if self.pool_grouping not in POOL_GROUPING:
            raise ValueError(f"pool_grouping: expected one of {POOL_GROUPING}, got {self.pool_grouping!r}")
        if self.window is not None and self.window < 0:
            raise ValueError(f"window: must be >= 0 or None, got {self.window}")
        if self.max_blocks is not None and self.max_blocks <= 0:
            raise ValueError(f"max_blocks: must be > 0, got {self.max_blocks}")
        for name in ("k_scale", "v_scale"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}: must be finite and > 0, got {v}")


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

    def __str__(self) -> str:
        lines = [f"rewrote {len(self.layers)} attention layer(s); nodes {self.nodes_before} -> {self.nodes_after}; "
                 f"positions {'explicit (position_ids input)' if self.explicit_positions else 'past_len + i'}"]
        for r in self.layers:
            rope = r.rope
            rope_text = ("none" if rope.style == RopeStyle.NONE else
                         f"{rope.style.name.lower()} dim={rope.rotary_dim or r.head_dim} theta={rope.theta:g}"
                         + (f" {rope.scaling.name.lower()} x{rope.factor:g}" if rope.scaling else ""))
            lines.append(
                f"  layer {r.index} [{r.pattern} @ {r.anchor}] heads={r.num_heads} kv_heads={r.num_kv_heads} "
                f"head_dim={r.head_dim} rope=({rope_text}) bias={int(r.qkv_bias)} fused_qkv={int(r.fused_qkv)} "
                f"qk_norm={int(r.qk_norm)} window={r.window} sinks={r.attention_sinks} "
                f"scale={r.softmax_scale:.6g} softcap={r.logit_softcap:g} qkv={r.projection} pool_group={r.pool_group}")
        lines.append(f"  removed inputs: {', '.join(self.removed_inputs)}")
        lines.append(f"  removed outputs: {', '.join(self.removed_outputs)}")
        return "\n".join(lines)


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
    ids = [n for n in ints if any(c.op_type == "Gather" and c.input[1] == n and view.constant(c.input[0]) is not None
                                  and view.constant(c.input[0]).ndim == 2 for c in view.consumers.get(n, []))]
    if len(ids) > 1:  # a sin/cos table is gathered by position too: the token ids are what the layers read
        hidden = view.ancestors([find_projection(view, matches[0].q_end).input[0]])
        ids = [n for n in ids if n in hidden] if len([n for n in ids if n in hidden]) == 1 else ids
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


@dataclass
class _LayerPlan:
    match: patterns.AttentionMatch
    chains: dict  # "q" | "k" | "v" -> ProjectionChain
    colmaps: dict  # "q" | "k" | "v" -> [heads, head_dim] projection columns
    report: LayerReport


def _analyze(view: GraphView, m: patterns.AttentionMatch, step: ProbeStep, index: int,
             options: RewriteOptions) -> _LayerPlan:
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
        if options.require_rope:
            raise RewriteError(f"{describe(m.anchor)}: expected RoPE on q and k between the projections "
                               f"({chains['k'].matmul.name!r}) and attention, found none")
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
                                        if isinstance(getattr(rope, f.name), float)})
    hidden = {chains["q"].hidden: np.zeros((1, CACHE_PROBE[1], view.constant(chains["q"].weight).shape[0]),
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


def _as_attribute(value: float) -> float:
    """The value an ONNX FLOAT attribute (float32) carries: what the plugin will see, and what the report says."""
    return float(np.float32(value))


def _pool_groups(plans: list[_LayerPlan], options: RewriteOptions) -> list[PoolGroup]:
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
    groups = []
    for g, ((kv_heads, head_dim, window, sinks, *_), layers) in enumerate(keys.items()):
        n = len(layers)
        try:
            groups.append(PoolGroup(f"group{g}", KVLayout(n, kv_heads, options.page_size, head_dim),
                                    options.cache_dtype, window=window, attention_sinks=sinks,
                                    k_scales=(options.k_scale,) * n, v_scales=(options.v_scale,) * n,
                                    layers=tuple(layers)))
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
            weights = {n: self.view.constant(chains[n].weight) for n in chains}
            columns = [colmaps[n].ravel() for n in ("q", "k", "v")]
            same = len({chains[n].weight for n in chains}) == 1
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
            x = self.tensors[cut]
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
                  **write.to_attributes())
        out = self.var(f"{prefix}/attn_out", self.dtype, [NUM_TOKENS, q_width])
        self.node(ATTENTION_PLUGIN_NAME, [q, *inputs[1:5], status], [out], f"{prefix}/{ATTENTION_PLUGIN_NAME}",
                  domain=ONNX_DOMAIN, **attention.to_attributes())
        # The o_proj input keeps its name and its consumers stay untouched: only its producer changes.
        merged = self.tensors[m.out]
        merged.inputs.clear()
        merged.dtype, merged.shape = self.dtype, [1, NUM_TOKENS, q_width]
        self.node("Reshape", [out, self.const(f"{prefix}/attn_out.shape", np.asarray([1, -1, q_width], np.int64))],
                  [merged], f"{prefix}/attn_out/Reshape")
        return status


def _engine_tensor(name: str, spec: engine_io.TensorSpec, dims: dict[str, int]) -> gs.Variable:
    """An engine input or output as ``pagedkv.engine_io`` describes it, the symbolic dims in ``dims`` fixed."""
    return gs.Variable(name, dtype=spec.dtype, shape=list(engine_io.resolve_shape(spec, dims)))


def _emit(model, view, plans, groups, roles, options, explicit: bool) -> tuple[gs.Graph, list, list]:
    em = _Emitter(model, view, roles)
    em.dtype = em.tensors[plans[0].match.q_end].dtype or np.float32
    dims = {engine_io.NUM_POOL_GROUPS: len(groups)}
    if options.max_blocks:
        dims[engine_io.MAX_BLOCKS] = options.max_blocks
    # every engine input but input_ids, which the graph has (its shape is set below)
    engine = {name: _engine_tensor(name, spec, dims) for name, spec in engine_io.engine_inputs(len(groups), explicit)
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
    em.graph.cleanup(remove_unused_graph_inputs=False).toposort()
    removed_inputs = [n for n in replaced if n in old_inputs]
    return em.graph, removed_inputs, removed_outputs


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


def _finish(graph: gs.Graph, model: onnx.ModelProto) -> onnx.ModelProto:
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
    _check(out, model)
    return out


UNCHECKED_DOMAIN = "pagedkv.unchecked"


def _check(out: onnx.ModelProto, model: onnx.ModelProto) -> None:
    """onnx.checker and strict shape inference on the result's weightless skeleton (``onnx_io.skeleton``: any size;
    ``onnx_io.save`` checks the written file, weights included, by path). Ops the input model already carried in the
    default domain that onnx has no schema for (ORT's transformer optimizer writes ``SimplifiedLayerNormalization``
    there: ONNX Runtime registers it, onnx does not) are untouched by the rewrite: they are checked like custom
    ops."""
    foreign = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)}
    checked = onnx_io.skeleton(out)
    if foreign:
        for node in checked.graph.node:
            if node.domain in ("", "ai.onnx") and node.op_type in foreign:
                node.domain = UNCHECKED_DOMAIN
        checked.opset_import.append(onnx.helper.make_opsetid(UNCHECKED_DOMAIN, 1))
    onnx.checker.check_model(checked)
    onnx.shape_inference.infer_shapes(checked, strict_mode=True)


def rewrite_model(model: onnx.ModelProto | str | Path, options: RewriteOptions | None = None) -> RewriteResult:
    """Rewrite every attention layer into the pagedkv plugins. Raises RewriteError, never returns a
    half-rewritten graph (the input model is not modified). ``model``: a path (``onnx_io.load``: any size) or a
    ``ModelProto``; the result refers to the input's external weights, ``onnx_io.save`` writes it."""
    options = options or RewriteOptions()
    model = copy.deepcopy(model) if isinstance(model, onnx.ModelProto) else onnx_io.load(model)
    view = GraphView(model)
    anchors = patterns.find_kv_anchors(view)
    if not anchors:
        raise RewriteError("no past-KV input found: expected rank-4 graph inputs that enter a node (Concat or an "
                           "attention op) whose output is a graph output (the present)")
    matches = patterns.match_all(view, anchors)
    claimed = {a for m in matches for a in (m.past_key, m.past_value)}
    for anchor in anchors:
        if anchor.past not in claimed:
            raise RewriteError(f"{describe(anchor.node)}: past input {anchor.past!r} was not matched to an attention")
    order = {name: i for i, name in enumerate(view.graph_outputs)}
    matches.sort(key=lambda m: order[m.present_key])
    roles, past_shape, int_types = _input_roles(view, matches)
    step = ProbeStep(roles, past_shape, int_types=int_types)
    plans = [_analyze(view, m, step, i, options) for i, m in enumerate(matches)]
    groups = _pool_groups(plans, options)
    explicit = bool(options.explicit_positions)
    graph, removed_inputs, removed_outputs = _emit(model, view, plans, groups, roles, options, explicit)
    reads = _still_read(graph, {n for n, role in roles.items() if role != "input_ids"})
    position_reads = {n for n in reads if roles[n] == "position_ids"}
    if position_reads and not explicit:
        if options.explicit_positions is False:
            raise RewriteError(f"explicit_positions=False, but nodes outside attention read position_ids: "
                               f"{reads[next(iter(position_reads))]}")
        explicit = True
        graph, removed_inputs, removed_outputs = _emit(model, view, plans, groups, roles, options, explicit)
        reads = _still_read(graph, {n for n, role in roles.items() if role not in ("input_ids", "position_ids")})
    _fold_shape_reads(graph, reads, roles, past_shape)
    reads = _still_read(graph, {n for n in reads if roles[n] != "position_ids" or not explicit})
    for name, readers in reads.items():
        if roles[name] != "position_ids":
            raise RewriteError(f"graph input {name!r} ({roles[name]}) is still read outside attention by "
                               f"{readers[:3]}: the packed graph cannot provide it")
    out = _finish(graph, model)
    report = RewriteReport([p.report for p in plans], explicit, sorted(removed_inputs), removed_outputs,
                           len(model.graph.node), len(out.graph.node))
    return RewriteResult(out, report, groups)


# ---- `pagedkv rewrite` -----------------------------------------------------------------------------------
def add_rewrite_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("input", help="exported decoder-with-past ONNX model")
    parser.add_argument("-o", "--output", required=True, help="where to write the rewritten model")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument("--cache-dtype", default="fp16", help="fp16 | bf16 | fp8 | int8 (default fp16)")
    parser.add_argument("--k-scale", type=float, default=1.0, help="quantized caches: K ~= stored * k_scale")
    parser.add_argument("--v-scale", type=float, default=1.0, help="quantized caches: V ~= stored * v_scale")
    parser.add_argument("--window", type=int, default=None,
                        help="override the sliding window found in the graph (0: full causal)")
    parser.add_argument("--max-blocks", type=int, default=None, help="static block-table width (default dynamic)")
    parser.add_argument("--pool-grouping", choices=POOL_GROUPING, default="auto",
                        help="auto: one pool per (kv heads, head dim, window); single; per_layer")
    parser.add_argument("--explicit-positions", action=argparse.BooleanOptionalAction, default=None,
                        help="add a position_ids engine input (default: only when needed)")
    parser.add_argument("--allow-no-rope", action="store_true", help="accept attention without RoPE")
    return parser


def options_from_args(args: argparse.Namespace) -> RewriteOptions:
    return RewriteOptions(page_size=args.page_size, cache_dtype=args.cache_dtype, k_scale=args.k_scale,
                          v_scale=args.v_scale, window=args.window, max_blocks=args.max_blocks,
                          pool_grouping=args.pool_grouping, explicit_positions=args.explicit_positions,
                          require_rope=not args.allow_no_rope)


def run_rewrite(args: argparse.Namespace) -> int:
    try:
        result = rewrite_model(args.input, options_from_args(args))
    except RewriteError as exc:
        print(f"pagedkv rewrite: {exc}", file=sys.stderr)
        return 1
    path = onnx_io.save(result.model, args.output, inputs=[args.input])
    print(result.report)
    print(f"wrote {path} and {onnx_io.data_path(path).name}")
    return 0
