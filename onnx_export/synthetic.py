"""The dependency-free synthetic decoder generator: numpy weights -> an ONNX decoder-with-past graph.

It writes the structures real exporters produce, so that the rewrite (``pagedkv.builder.rewrite``) can be
tested without torch: MHA / GQA / MQA, QKV bias, fused or separate projections, rotate-half (NeoX) or
interleaved (GPT-J) RoPE from an in-graph outer product or a position-indexed sin/cos table, partial rotary,
RoPE scaling (YaRN's attention factor on cos and sin; LongRoPE's two tables switched on max(position_ids) + 1,
as transformers' longrope update does, in the decomposed form from the outer product), a sliding window built
into the in-graph mask, head dims 32..256, Qwen3's q/k RMSNorm, the
softmax scale as one Mul on the scores or sqrt(scale) on both Q and K, and the GQA repeat after the past/present
Concat. ``attention_form`` picks how attention itself is written:

    decomposed      PyTorch's legacy exporter (opset 17): Concat / MatMul / Softmax / MatMul, RoPE from Cos/Sin
    contrib_rotary  the decomposed attention, RoPE as ``com.microsoft::RotaryEmbedding`` (ORT optimizer style)
    contrib_gqa     ``com.microsoft::GroupQueryAttention`` with the rotary inside (ORT optimizer style)
    onnx23          opset 23 ``RotaryEmbedding`` + ``Attention`` (what the dynamo exporter emits at opset 23)

Graph I/O (the usual decoder-with-past convention)::

    input_ids      int64 [batch, seq]
    attention_mask int64 [batch, past + seq]
    position_ids   int64 [batch, seq]
    past_key_values.{i}.key|value  float32 [batch, kv_heads, past, head_dim]
    -> logits float32 [batch, seq, vocab], present.{i}.key|value float32 [batch, kv_heads, past + seq, head_dim]

Example::

    from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic
    export_synthetic(SyntheticConfig(num_heads=4, num_kv_heads=2, qkv_bias=True), "tiny.onnx")
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from pagedkv.config import RopeConfig, RopeScaling, RopeStyle
from pagedkv.onnx_export._synthetic_graph import BOOL, FLOAT, INT32, INT64, MS_DOMAIN, GraphBuilder

ATTENTION_FORMS = ("decomposed", "contrib_rotary", "contrib_gqa", "onnx23")
ROPE_SOURCES = ("outer", "table")  # Cos/Sin of position_ids x inv_freq, or Gather from a sin/cos table
SCALE_MODES = ("scores", "sqrt_qk")
MASK_MIN = float(np.finfo(np.float32).min)  # what transformers adds for masked positions


@dataclass(frozen=True)
class SyntheticConfig:
    """One synthetic decoder. Frozen and self-checking, with a readable ``id`` for test parametrization."""

    num_layers: int = 2
    hidden: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 128
    intermediate: int = 192
    qkv_bias: bool = False
    fused_qkv: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    rope: RopeConfig = field(default_factory=RopeConfig)  # style NONE is not offered: every family has RoPE
    rope_source: str = "outer"
    sliding_window: int = 0  # 0: full causal
    softmax_scale: float = 0.0  # 0 -> 1/sqrt(head_dim)
    logit_softcap: float = 0.0  # > 0: Gemma-2's cap * tanh(scores / cap) before the mask
    scale_mode: str = "scores"
    attention_form: str = "decomposed"
    max_positions: int = 4096  # rows of the sin/cos tables
    rms_eps: float = 1e-6
    seed: int = 0

    def __post_init__(self):
        if self.attention_form not in ATTENTION_FORMS:
            raise ValueError(f"attention_form: expected one of {ATTENTION_FORMS}, got {self.attention_form!r}")
        if self.rope_source not in ROPE_SOURCES:
            raise ValueError(f"rope_source: expected one of {ROPE_SOURCES}, got {self.rope_source!r}")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode: expected one of {SCALE_MODES}, got {self.scale_mode!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads}: must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope.style == RopeStyle.NONE:
            if self.attention_form != "decomposed":
                raise ValueError(f"rope.style: NONE (no RoPE) exists only in the decomposed form, not "
                                 f"{self.attention_form!r}")
        else:
            self.rope.resolved_rotary_dim(self.head_dim)
        if self.rope.scaling == RopeScaling.LONGROPE and (self.attention_form, self.rope_source) != ("decomposed",
                                                                                                 "outer"):
            raise ValueError(f"rope.scaling: LONGROPE switches tables by the step's length, which only the decomposed "
                             f"form from the outer product writes (got {self.attention_form!r}, {self.rope_source!r}: "
                             "a sin/cos table has one frequency set)")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window: must be >= 0, got {self.sliding_window}")
        if not (math.isfinite(self.logit_softcap) and self.logit_softcap >= 0):
            raise ValueError(f"logit_softcap: must be finite and >= 0, got {self.logit_softcap}")

    @property
    def rotary_dim(self) -> int:
        return 0 if self.rope.style == RopeStyle.NONE else self.rope.resolved_rotary_dim(self.head_dim)

    @property
    def resolved_softmax_scale(self) -> float:
        return self.softmax_scale or 1.0 / math.sqrt(self.head_dim)

    @property
    def opset(self) -> int:
        return 23 if self.attention_form == "onnx23" else 17

    @property
    def id(self) -> str:
        parts = [self.attention_form, f"h{self.num_heads}kv{self.num_kv_heads}d{self.head_dim}",
                 self.rope.style.name.lower(), self.rope_source]
        if self.rotary_dim not in (0, self.head_dim):
            parts.append(f"r{self.rotary_dim}")
        if self.rope.scaling:
            parts.append(self.rope.scaling.name.lower())
        parts += [flag for flag, on in (("bias", self.qkv_bias), ("fused", self.fused_qkv), ("qknorm", self.qk_norm),
                                        ("sqrtqk", self.scale_mode == "sqrt_qk")) if on]
        if self.sliding_window:
            parts.append(f"w{self.sliding_window}")
        if self.softmax_scale:
            parts.append(f"s{self.softmax_scale:g}")
        if self.logit_softcap:
            parts.append(f"cap{self.logit_softcap:g}")
        return "-".join(parts)

    def replace(self, **changes) -> "SyntheticConfig":
        return dataclasses.replace(self, **changes)


# ---- weights --------------------------------------------------------------------------------------------
def make_weights(cfg: SyntheticConfig) -> dict[str, np.ndarray]:
    """Random float32 weights, scaled so activations stay O(1) through the layers."""
    rng = np.random.default_rng(cfg.seed)
    H, KVH, D, hid = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden

    def dense(fan_in, fan_out):
        return (rng.standard_normal((fan_in, fan_out)) / math.sqrt(fan_in)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"embed": rng.standard_normal((cfg.vocab, hid)).astype(np.float32),
         "final_norm": norm(hid), "lm_head": dense(hid, cfg.vocab)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w[p + "input_norm"] = norm(hid)
        w[p + "post_norm"] = norm(hid)
        w[p + "q"], w[p + "k"], w[p + "v"] = dense(hid, H * D), dense(hid, KVH * D), dense(hid, KVH * D)
        if cfg.qkv_bias:
            for name, n in (("q", H * D), ("k", KVH * D), ("v", KVH * D)):
                w[p + name + "_bias"] = (0.5 * rng.standard_normal(n)).astype(np.float32)
        if cfg.qk_norm:
            w[p + "q_norm"], w[p + "k_norm"] = norm(D), norm(D)
        w[p + "o"] = dense(H * D, hid)
        w[p + "gate"], w[p + "up"] = dense(hid, cfg.intermediate), dense(hid, cfg.intermediate)
        w[p + "down"] = dense(cfg.intermediate, hid)
    return w


def rope_tables(cfg: SyntheticConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [max_positions, R/2]: row p holds the angles p * inv_freq, times the attention factor."""
    from pagedkv.reference.rope import attention_factor, rope_inv_freq

    angles = np.arange(cfg.max_positions, dtype=np.float64)[:, None] * rope_inv_freq(cfg.head_dim, cfg.rope)[None]
    m = attention_factor(cfg.rope)
    return (m * np.cos(angles)).astype(np.float32), (m * np.sin(angles)).astype(np.float32)


# ---- graph ----------------------------------------------------------------------------------------------
class _Decoder:
    """Writes the decoder into a GraphBuilder, one method per block."""

    def __init__(self, cfg: SyntheticConfig, weights: dict[str, np.ndarray]):
        self.cfg, self.w = cfg, weights
        self.g = GraphBuilder(cfg.opset)

    def weight(self, key: str) -> str:
        return self.g.const(self.w[key], name=f"model.{key}")

    def rms_norm(self, x: str, weight: str) -> str:
        g = self.g
        var = g.reduce_mean_last(g.op("Pow", [x, g.f32(2.0)]))
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [var, g.f32(self.cfg.rms_eps)])])])
        return g.op("Mul", [weight, g.op("Mul", [x, inv])])

    # ---- inputs, mask, rotary sources -----------------------------------------------------------------
    def declare_io(self):
        g, c = self.g, self.cfg
        self.input_ids = g.input("input_ids", INT64, ["batch", "seq"])
        self.attention_mask = g.input("attention_mask", INT64, ["batch", "total"])
        self.position_ids = g.input("position_ids", INT64, ["batch", "seq"])
        self.past = [(g.input(f"past_key_values.{i}.key", FLOAT, ["batch", c.num_kv_heads, "past", c.head_dim]),
                      g.input(f"past_key_values.{i}.value", FLOAT, ["batch", c.num_kv_heads, "past", c.head_dim]))
                     for i in range(c.num_layers)]

    def additive_mask(self) -> str:
        """[batch, 1, seq, total] float: 0 where visible, MASK_MIN elsewhere (causal, window, padding)."""
        g, c = self.g.scope("/model/mask"), self.cfg
        total = g.op("Gather", [g.op("Shape", [self.attention_mask]), g.i64(1)], axis=0)
        seq = g.op("Gather", [g.op("Shape", [self.input_ids]), g.i64(1)], axis=0)
        q_pos = g.unsqueeze(g.op("Range", [g.op("Sub", [total, seq]), total, g.i64(1)]), [1])  # [seq, 1]
        kv_pos = g.op("Range", [g.i64(0), total, g.i64(1)])  # [total]
        allowed = g.op("LessOrEqual", [kv_pos, q_pos])
        if c.sliding_window:
            in_window = g.op("Greater", [kv_pos, g.op("Sub", [q_pos, g.i64(c.sliding_window)])])
            allowed = g.op("And", [allowed, in_window])
        not_padding = g.unsqueeze(g.op("Cast", [self.attention_mask], to=BOOL), [1, 2])  # [batch, 1, 1, total]
        allowed = g.op("And", [g.unsqueeze(allowed, [0, 1]), not_padding])
        return g.op("Where", [allowed, g.f32(0.0), g.f32(MASK_MIN)])

    def rotary_cos_sin(self) -> tuple[str, str]:
        """cos, sin [batch, seq, R] in the pair order of the rope style (decomposed forms)."""
        g, c = self.g.scope("/model/rotary"), self.cfg
        half = c.rotary_dim // 2
        if c.rope_source == "outer":  # transformers' LlamaRotaryEmbedding: inv_freq[:, None] @ positions[None, :]
            from pagedkv.reference.rope import attention_factor, long_table_above, rope_inv_freq

            def table(long: bool) -> str:
                values = rope_inv_freq(c.head_dim, c.rope, long=long).astype(np.float32).reshape(1, half, 1)
                return g.const(values, name=f"model.rotary_emb.{'long_' if long else ''}inv_freq")

            inv_freq = table(long=False)
            if long_table_above(c.rope):  # transformers' longrope update: where(max(position_ids) + 1 > N, long, short)
                seq_len = g.op("Add", [g.op("ReduceMax", [self.position_ids], keepdims=0), g.i64(1)])
                longer = g.op("Greater", [seq_len, g.i64(long_table_above(c.rope))])
                inv_freq = g.op("Where", [longer, table(long=True), inv_freq])
            batch = g.dim(self.position_ids, 0)
            inv_freq = g.op("Expand", [inv_freq, g.op("Concat", [batch, g.i64([1, 1])], axis=0)])  # [batch, R/2, 1]
            positions = g.unsqueeze(g.op("Cast", [self.position_ids], to=FLOAT), [1])  # [batch, 1, seq]
            freqs = g.op("Transpose", [g.op("MatMul", [inv_freq, positions])], perm=[0, 2, 1])  # [batch, seq, R/2]
            cos_half, sin_half = g.op("Cos", [freqs]), g.op("Sin", [freqs])
            m = attention_factor(c.rope)
            if m != 1.0:  # transformers: cos() * attention_scaling
                cos_half, sin_half = (g.op("Mul", [t, g.f32(m)]) for t in (cos_half, sin_half))
        else:  # GPT-J's embed_positions: one [max_positions, R] table of (sin | cos), gathered by position
            cos_t, sin_t = rope_tables(c)
            table = g.const(np.concatenate([sin_t, cos_t], axis=1), name="model.rotary_emb.embed_positions")
            sincos = g.op("Gather", [table, self.position_ids], axis=0)  # [batch, seq, R]
            sin_half, cos_half = g.op("Split", [sincos, g.i64([half, half])], num_outputs=2, axis=-1)
        return self._spread(cos_half), self._spread(sin_half)

    def _spread(self, half: str) -> str:
        """[batch, seq, R/2] -> [batch, seq, R]: duplicated (NeoX) or repeat-interleaved (GPT-J)."""
        g = self.g
        if self.cfg.rope.style == RopeStyle.NEOX:
            return g.op("Concat", [half, half], axis=-1)
        pairs = g.op("Concat", [g.unsqueeze(half, [-1]), g.unsqueeze(half, [-1])], axis=-1)
        return g.op("Reshape", [pairs, g.i64([0, 0, self.cfg.rotary_dim])])

    def rotary_caches(self) -> tuple[str, str]:
        cos_t, sin_t = rope_tables(self.cfg)
        return self.g.const(cos_t, name="model.rotary_emb.cos_cache"), self.g.const(sin_t, name="model.rotary_emb.sin_cache")

    # ---- attention pieces -----------------------------------------------------------------------------
    def apply_rope(self, x: str, cos: str, sin: str) -> str:
        """Decomposed RoPE on ``x`` [..., D] with cos/sin broadcastable to [..., R]."""
        g, c = self.g, self.cfg
        R, D = c.rotary_dim, c.head_dim
        x_rot = g.slice_last(x, 0, R) if R < D else x
        if c.rope.style == RopeStyle.NEOX:  # rotate_half: (-x2, x1)
            x1, x2 = g.slice_last(x_rot, 0, R // 2), g.slice_last(x_rot, R // 2, R)
            rotated = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
        else:  # rotate_every_two: stack((-x_odd, x_even), -1).flatten(-2)
            x_even, x_odd = g.slice_last(x_rot, 0, R, 2), g.slice_last(x_rot, 1, R, 2)
            stacked = g.op("Concat", [g.unsqueeze(g.op("Neg", [x_odd]), [-1]), g.unsqueeze(x_even, [-1])], axis=-1)
            rotated = g.op("Reshape", [stacked, g.i64([0, 0, 0, R])])
        out = g.op("Add", [g.op("Mul", [x_rot, cos]), g.op("Mul", [rotated, sin])])
        return g.op("Concat", [out, g.slice_last(x, R, D)], axis=-1) if R < D else out

    def projections(self, i: int, h: str) -> tuple[str, str, str]:
        """q [B, S, H*D], k, v [B, S, KVH*D] (biases added)."""
        g, c, p = self.g, self.cfg, f"layers.{i}."
        names = ("q", "k", "v")
        if c.fused_qkv:
            weight = g.const(np.concatenate([self.w[p + n] for n in names], axis=1), name=f"model.{p}qkv_proj.weight")
            qkv = g.op("MatMul", [h, weight])
            if c.qkv_bias:
                bias = np.concatenate([self.w[p + n + "_bias"] for n in names])
                qkv = g.op("Add", [qkv, g.const(bias, name=f"model.{p}qkv_proj.bias")])
            sizes = [c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2
            return tuple(g.op("Split", [qkv, g.i64(sizes)], num_outputs=3, axis=-1))
        out = []
        for n in names:
            y = g.op("MatMul", [h, self.weight(p + n)])
            if c.qkv_bias:
                y = g.op("Add", [self.weight(p + n + "_bias"), y])  # bias first: operand order must not matter
            out.append(y)
        return tuple(out)

    def split_heads(self, x: str, heads: int) -> str:
        """[B, S, N*D] -> [B, S, N, D], the target shape built from Shape like the exporter does."""
        g, D = self.g, self.cfg.head_dim
        shape = g.op("Concat", [g.dim(x, 0), g.dim(x, 1), g.i64([heads]), g.i64([D])], axis=0)
        return g.op("Reshape", [x, shape])

    def head_norm(self, i: int, x: str, which: str) -> str:
        return self.rms_norm(x, self.weight(f"layers.{i}.{which}_norm"))

    def repeat_kv(self, x: str) -> str:
        """transformers' repeat_kv: [B, KVH, L, D] -> [B, H, L, D], head h reads kv head h // n_rep."""
        g, c = self.g, self.cfg
        n_rep = c.num_heads // c.num_kv_heads
        if n_rep == 1:
            return x
        batch, length = g.dim(x, 0), g.dim(x, 2)
        expanded = g.op("Expand", [g.unsqueeze(x, [2]), g.op("Concat", [
            batch, g.i64([c.num_kv_heads, n_rep]), length, g.i64([c.head_dim])], axis=0)])
        return g.op("Reshape", [expanded, g.op("Concat", [batch, g.i64([c.num_heads]), length, g.i64([c.head_dim])],
                                                axis=0)])

    def attention_decomposed(self, i: int, h: str, mask: str, rotary) -> str:
        g, c = self.g.scope(f"/model/layers.{i}/attn"), self.cfg
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        q, k, v = self.projections(i, h)
        if c.attention_form == "contrib_rotary":
            q, k = (self._contrib_rope(i, x, n, which, rotary) for x, n, which in ((q, H, "q"), (k, KVH, "k")))
        q, k, v = self.split_heads(q, H), self.split_heads(k, KVH), self.split_heads(v, KVH)  # [B, S, N, D]
        if c.qk_norm and c.attention_form != "contrib_rotary":
            q, k = self.head_norm(i, q, "q"), self.head_norm(i, k, "k")
        to_bhsd = dict(perm=[0, 2, 1, 3])
        rotate = c.rope.style != RopeStyle.NONE
        if rotate and c.attention_form == "decomposed" and c.rope_source == "table":  # GPT-J: in [B, S, N, D]
            cos, sin = (g.unsqueeze(t, [2]) for t in rotary)
            q, k = self.apply_rope(q, cos, sin), self.apply_rope(k, cos, sin)
        q, k, v = (g.op("Transpose", [t], **to_bhsd) for t in (q, k, v))  # [B, N, S, D]
        if rotate and c.attention_form == "decomposed" and c.rope_source == "outer":  # Llama: in [B, N, S, D]
            cos, sin = (g.unsqueeze(t, [1]) for t in rotary)
            q, k = self.apply_rope(q, cos, sin), self.apply_rope(k, cos, sin)
        past_k, past_v = self.past[i]
        k_all = g.op("Concat", [past_k, k], axis=2, outputs=[f"present.{i}.key"])
        v_all = g.op("Concat", [past_v, v], axis=2, outputs=[f"present.{i}.value"])
        k_rep, v_rep = self.repeat_kv(k_all), self.repeat_kv(v_all)
        k_t = g.op("Transpose", [k_rep], perm=[0, 1, 3, 2])
        scale = c.resolved_softmax_scale
        if c.scale_mode == "sqrt_qk":  # torch's SDPA decomposition: sqrt(scale) on both sides
            q = g.op("Mul", [q, g.f32(math.sqrt(scale))])
            k_t = g.op("Mul", [k_t, g.f32(math.sqrt(scale))])
        scores = g.op("MatMul", [q, k_t])
        if c.scale_mode == "scores":
            scores = g.op("Mul", [scores, g.f32(scale)])
        if c.logit_softcap:  # transformers' Gemma-2: scores / cap, tanh, * cap, then the mask
            cap = g.f32(c.logit_softcap)
            scores = g.op("Mul", [g.op("Tanh", [g.op("Div", [scores, cap])]), cap])
        probs = g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1)
        out = g.op("MatMul", [probs, v_rep])  # [B, H, S, D]
        out = g.op("Transpose", [out], **to_bhsd)
        return g.op("Reshape", [out, g.i64([0, 0, H * D])])

    def _contrib_rope(self, i: int, x: str, heads: int, which: str, caches) -> str:
        """com.microsoft::RotaryEmbedding on [B, S, N*D] (q/k norm first when asked, as [B, S, N, D])."""
        g, c = self.g, self.cfg
        if c.qk_norm:
            x = g.op("Reshape", [self.head_norm(i, self.split_heads(x, heads), which), g.i64([0, 0, heads * c.head_dim])])
        cos, sin = caches
        return g.op("RotaryEmbedding", [x, self.position_ids, cos, sin], domain=MS_DOMAIN, num_heads=heads,
                    rotary_embedding_dim=c.rotary_dim, interleaved=int(c.rope.style == RopeStyle.GPTJ))

    def attention_gqa(self, i: int, h: str, seqlens_k: str, total_len: str, caches) -> str:
        g, c = self.g.scope(f"/model/layers.{i}/attn"), self.cfg
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        q, k, v = self.projections(i, h)
        if c.qk_norm:
            q, k = (g.op("Reshape", [self.head_norm(i, self.split_heads(x, n), which), g.i64([0, 0, n * D])])
                    for x, n, which in ((q, H, "q"), (k, KVH, "k")))
        past_k, past_v = self.past[i]
        out = g.op("GroupQueryAttention", [q, k, v, past_k, past_v, seqlens_k, total_len, *caches], domain=MS_DOMAIN,
                   outputs=[f"/model/layers.{i}/attn/GroupQueryAttention_out", f"present.{i}.key", f"present.{i}.value"],
                   num_heads=H, kv_num_heads=KVH, scale=c.resolved_softmax_scale, softcap=c.logit_softcap, do_rotary=1,
                   rotary_interleaved=int(c.rope.style == RopeStyle.GPTJ),
                   local_window_size=gqa_local_window_size(c.sliding_window))
        return out[0]

    def attention_onnx23(self, i: int, h: str, mask: str, caches) -> str:
        g, c = self.g.scope(f"/model/layers.{i}/attn"), self.cfg
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        q, k, v = self.projections(i, h)
        q, k, v = self.split_heads(q, H), self.split_heads(k, KVH), self.split_heads(v, KVH)
        if c.qk_norm:
            q, k = self.head_norm(i, q, "q"), self.head_norm(i, k, "k")
        q, k, v = (g.op("Transpose", [t], perm=[0, 2, 1, 3]) for t in (q, k, v))
        cos, sin = caches
        q, k = (g.op("RotaryEmbedding", [t, cos, sin, self.position_ids], rotary_embedding_dim=c.rotary_dim,
                     interleaved=int(c.rope.style == RopeStyle.GPTJ)) for t in (q, k))
        past_k, past_v = self.past[i]
        out = g.op("Attention", [q, k, v, mask, past_k, past_v],
                   outputs=[f"/model/layers.{i}/attn/Attention_out", f"present.{i}.key", f"present.{i}.value"],
                   scale=c.resolved_softmax_scale, softcap=c.logit_softcap)[0]
        out = g.op("Transpose", [out], perm=[0, 2, 1, 3])
        return g.op("Reshape", [out, g.i64([0, 0, H * D])])

    # ---- the decoder ----------------------------------------------------------------------------------
    def build(self) -> onnx.ModelProto:
        c = self.cfg
        self.declare_io()
        g = self.g.scope("/model/embed")
        x = g.op("Gather", [self.weight("embed"), self.input_ids], axis=0)
        form = c.attention_form
        if form == "contrib_gqa":
            g.scope("/model/mask")
            seqlens_k = g.op("Cast", [g.op("Sub", [g.op("ReduceSum", [self.attention_mask, g.i64([1])], keepdims=0),
                                                   g.i64(1)])], to=INT32)
            total_len = g.op("Cast", [g.op("Gather", [g.op("Shape", [self.attention_mask]), g.i64(1)], axis=0)], to=INT32)
        else:
            mask = self.additive_mask()
        if c.rope.style == RopeStyle.NONE:
            rotary = None
        else:
            rotary = self.rotary_cos_sin() if form == "decomposed" else self.rotary_caches()
        for i in range(c.num_layers):
            p = f"layers.{i}."
            g = self.g.scope(f"/model/layers.{i}/input_layernorm")
            h = self.rms_norm(x, self.weight(p + "input_norm"))
            if form == "contrib_gqa":
                attn = self.attention_gqa(i, h, seqlens_k, total_len, rotary)
            elif form == "onnx23":
                attn = self.attention_onnx23(i, h, mask, rotary)
            else:
                attn = self.attention_decomposed(i, h, mask, rotary)
            g = self.g.scope(f"/model/layers.{i}/o_proj")
            x = g.op("Add", [x, g.op("MatMul", [attn, self.weight(p + "o")])])
            g = self.g.scope(f"/model/layers.{i}/mlp")
            h = self.rms_norm(x, self.weight(p + "post_norm"))
            gate = g.op("MatMul", [h, self.weight(p + "gate")])
            act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), g.op("MatMul", [h, self.weight(p + "up")])])
            x = g.op("Add", [x, g.op("MatMul", [act, self.weight(p + "down")])])
        g = self.g.scope("/model/lm_head")
        g.op("MatMul", [self.rms_norm(x, self.weight("final_norm")), self.weight("lm_head")], outputs=["logits"])
        g.output("logits", FLOAT, ["batch", "seq", c.vocab])
        for i in range(c.num_layers):
            for kind in ("key", "value"):
                g.output(f"present.{i}.{kind}", FLOAT, ["batch", c.num_kv_heads, "total", c.head_dim])
        return g.model(f"pagedkv_synthetic_{c.id}")


def gqa_local_window_size(window: int) -> int:
    """Our window -> GroupQueryAttention's ``local_window_size`` (-1: none). They are the same number:
    onnxruntime 1.32's CPU kernel keeps the ``local_window_size`` most recent positions, the query's own
    included (measured against the decomposed form in tests/test_synthetic_export.py)."""
    return window if window > 0 else -1


def make_synthetic_model(cfg: SyntheticConfig, weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """Build the synthetic decoder (checked with ``onnx.checker``)."""
    model = _Decoder(cfg, weights if weights is not None else make_weights(cfg)).build()
    onnx.checker.check_model(model)
    return model


def export_synthetic(cfg: SyntheticConfig, path: str | Path) -> Path:
    """Write the synthetic decoder to ``path`` (+ ``path.data``: ``pagedkv.onnx_io.save``)."""
    from pagedkv import onnx_io

    return onnx_io.save(make_synthetic_model(cfg), path)


def structure_matrix() -> list[SyntheticConfig]:
    """The structures the rewrite must recognize, each in every attention form that can express it:
    a small, fast set (2 layers, hidden 128, vocab 128) for CPU tests, with readable ``cfg.id`` values."""
    gptj = RopeConfig(style=RopeStyle.GPTJ)
    yarn = RopeConfig(theta=1e6, scaling=RopeScaling.YARN, factor=4.0, original_max_positions=32768)
    longrope = RopeConfig(scaling=RopeScaling.LONGROPE, rotary_dim=48, original_max_positions=10, factor=32.0,
                          short_factors=tuple(1.0 + 0.02 * i for i in range(24)),
                          long_factors=tuple(1.0 + 1.5 * i for i in range(24)))
    structures = [
        SyntheticConfig(),                                                     # Llama: GQA, rotate-half
        SyntheticConfig(num_kv_heads=4, qkv_bias=True, rope=RopeConfig(theta=1e6)),  # Qwen2: MHA, QKV bias
        SyntheticConfig(num_kv_heads=1, head_dim=128, sliding_window=5, scale_mode="sqrt_qk",
                        rope=RopeConfig(scaling=RopeScaling.LINEAR, factor=4.0)),  # Mistral-like window, MQA
        SyntheticConfig(qk_norm=True, rope=RopeConfig(theta=1e6)),             # Qwen3: q/k RMSNorm before RoPE
        SyntheticConfig(num_kv_heads=4, fused_qkv=True, qkv_bias=True,
                        rope=RopeConfig(rotary_dim=16)),                       # GPT-NeoX: fused QKV, partial
        SyntheticConfig(num_kv_heads=4, head_dim=256, hidden=64, rope_source="table",
                        rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=64)),  # GPT-J: table, interleaved
        SyntheticConfig(num_kv_heads=4, fused_qkv=True, qkv_bias=True, softmax_scale=0.1,
                        rope=RopeConfig(rotary_dim=32)),                       # Phi: partial, explicit scale
        SyntheticConfig(num_heads=2, num_kv_heads=1, head_dim=256,
                        rope=RopeConfig(scaling=RopeScaling.LLAMA3, factor=8.0, theta=500000.0)),  # Gemma/Llama3
        SyntheticConfig(rope=gptj, qk_norm=True, sliding_window=3, fused_qkv=True),
        SyntheticConfig(head_dim=128, num_heads=2, num_kv_heads=1, qkv_bias=True, rope=yarn),  # Qwen2.5 YaRN
        SyntheticConfig(num_kv_heads=4, fused_qkv=True, rope=longrope),  # Phi-3-like LongRoPE, partial rotary
        SyntheticConfig(num_heads=2, num_kv_heads=1, head_dim=256, logit_softcap=2.5, softmax_scale=1 / 12,
                        sliding_window=4),  # Gemma-2: soft-cap, query_pre_attn_scalar, a window
    ]
    out = []
    for cfg in structures:
        for form in ATTENTION_FORMS:
            if form != "decomposed" and cfg.rope_source == "table":
                continue  # the fused forms always read a table: the structure is the decomposed one
            if form != "decomposed" and cfg.rope.scaling == RopeScaling.LONGROPE:
                continue  # the fused forms read one sin/cos table: no step-dependent switch
            out.append(cfg.replace(attention_form=form))
    return out
