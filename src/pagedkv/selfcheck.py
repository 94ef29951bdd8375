"""``pagedkv selfcheck``: the main job at this stage.

A small random model step, twice: a prefill of three ragged prompts, then a mixed step (two decodes and a
prefill chunk over a cached prefix), on shuffled pages of a bf16 pool. It runs

1. the float64 references (QKV write then paged attention), checked against a dense formulation built
   independently from the same projections (RoPE applied to dense K, causal softmax attention);
2. when a CUDA device is present, the CUDA kernels through the C API on the same inputs, checked against
   the references (bf16 tolerances), the pool compared slot by slot.

Exit status 0 when every check passes.
"""

from __future__ import annotations

import numpy as np

from pagedkv import cuda
from pagedkv.config import AttentionConfig, PoolConfig, RopeConfig, RopeStyle, WriteConfig
from pagedkv.layout import CacheDType
from pagedkv.reference import apply_rope, dense_attention, dequantize, quantize
from pagedkv.reference import paged_attention as ref_attention
from pagedkv.reference import qkv_write as ref_write
from pagedkv.step import StepMetadata
from pagedkv.tolerances import TOLERANCES

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 128, 16
PROMPTS = (37, 16, 50)  # step 1: prefill of each
STEP2 = (1, 20, 1)  # step 2: decode, a chunk over the cached prefix, decode


def _steps(rng: np.random.Generator, num_blocks: int):
    """Block tables over shuffled blocks and the two steps' metadata."""
    total = [p + s for p, s in zip(PROMPTS, STEP2)]
    pages = [-(-t // PAGE) for t in total]
    perm = rng.permutation(num_blocks)[: sum(pages)]
    width = max(pages)
    table = np.full((len(total), width), -1, np.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[start:start + n]
        start += n
    step1 = StepMetadata(table, np.concatenate([[0], np.cumsum(PROMPTS)]), np.zeros(len(PROMPTS)))
    step2 = StepMetadata(table, np.concatenate([[0], np.cumsum(STEP2)]), np.array(PROMPTS))
    return step1, step2


def _dense_check(qkv_steps, metas, wcfg: WriteConfig, acfg: AttentionConfig, outs) -> float:
    """Max relative error of the paged references against dense attention on dense, rotated K/V."""
    hd, h, kvh = HEAD_DIM, HEADS, KV_HEADS
    worst = 0.0
    for b in range(len(PROMPTS)):
        rows = np.concatenate([q[m.cu_q_lens[b]:m.cu_q_lens[b + 1]] for q, m in zip(qkv_steps, metas)])
        rows = rows.astype(np.float64).reshape(len(rows), h + 2 * kvh, hd)
        pos = np.arange(len(rows))
        q = apply_rope(rows[:, :h], pos, hd, wcfg.rope)
        # The pool stores bf16: round K and V the way the cache does, independently of the paged path.
        k = dequantize(quantize(apply_rope(rows[:, h:h + kvh], pos, hd, wcfg.rope), CacheDType.BF16), CacheDType.BF16)
        v = dequantize(quantize(rows[:, h + kvh:], CacheDType.BF16), CacheDType.BF16)
        dense = dense_attention(q, k, v, pos, pos, softmax_scale=acfg.resolved_softmax_scale)
        paged = np.concatenate([o[m.cu_q_lens[b]:m.cu_q_lens[b + 1]] for o, m in zip(outs, metas)])
        worst = max(worst, float(np.abs(paged - dense).max() / np.abs(dense).max()))
    return worst


def main(seed: int = 0, backend: str = "auto") -> int:
    import ml_dtypes

    from pagedkv.userio import UsageError

    no_gpu = cuda.why_no_gpu()
    if backend == "cuda" and no_gpu:  # refused before any check runs: one line on stderr, exit 2 (run_verb)
        raise UsageError(f"--backend cuda: {no_gpu}")

    rng = np.random.default_rng(seed)
    num_blocks = 64
    pool_cfg = PoolConfig(num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE, num_layers=2, layer_index=1,
                          cache_dtype=CacheDType.BF16)
    wcfg = WriteConfig(num_q_heads=HEADS, pool=pool_cfg, rope=RopeConfig(style=RopeStyle.NEOX, theta=10000.0),
                       has_bias=True)
    acfg = AttentionConfig(num_q_heads=HEADS, pool=pool_cfg)
    layout = pool_cfg.layout()
    metas = _steps(rng, num_blocks)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    bf16 = np.dtype(ml_dtypes.bfloat16)
    qkv_steps = [rng.standard_normal((m.num_tokens, width)).astype(bf16) for m in metas]
    bias = (0.1 * rng.standard_normal(width)).astype(bf16)

    # Poisoned pool: every slot nobody writes must stay NaN.
    pool_ref = np.full(layout.pool_shape(num_blocks), np.nan, dtype=bf16)
    outs_ref = []
    for qkv, meta in zip(qkv_steps, metas):
        q = ref_write(qkv, bias, meta, pool_ref, wcfg)
        outs_ref.append(ref_attention(q, meta, pool_ref, acfg))
    # The dense check applies the bias itself.
    qkv_biased = [(q.astype(np.float64) + bias.astype(np.float64)) for q in qkv_steps]
    dense_err = _dense_check(qkv_biased, metas, wcfg, acfg, outs_ref)
    ok = dense_err < 1e-9
    print(f"reference: paged write + paged attention vs dense attention   max rel err {dense_err:.2e}  "
          f"{'PASS' if ok else 'FAIL'}")

    if backend == "reference" or (backend == "auto" and no_gpu):
        print(f"cuda kernels: not run ({'--backend reference' if backend == 'reference' else no_gpu})")
        return 0 if ok else 1

    from pagedkv.kernels.attention import paged_attention_numpy
    from pagedkv.kernels.write import qkv_write_numpy

    atol, rtol = TOLERANCES["bfloat16"]
    pool_gpu = np.full(layout.pool_shape(num_blocks), np.nan, dtype=bf16)
    for step, (qkv, meta) in enumerate(zip(qkv_steps, metas), 1):
        q = qkv_write_numpy(qkv, bias, meta, pool_gpu, wcfg)
        out = paged_attention_numpy(np.asarray(q).reshape(meta.num_tokens, HEADS * HEAD_DIM), meta, pool_gpu, acfg)
        out = np.asarray(out, dtype=np.float64).reshape(meta.num_tokens, HEADS, HEAD_DIM)
        err = float(np.abs(out - outs_ref[step - 1]).max())
        good = np.allclose(out, outs_ref[step - 1], atol=atol, rtol=rtol)
        print(f"cuda step {step}: attention output vs reference   max abs err {err:.2e}  {'PASS' if good else 'FAIL'}")
        ok &= bool(good)
    a = pool_gpu.astype(np.float64)
    b = pool_ref.astype(np.float64)
    same_nan = bool(np.array_equal(np.isnan(a), np.isnan(b)))
    pool_ok = same_nan and np.allclose(a[~np.isnan(a)], b[~np.isnan(b)], atol=atol, rtol=rtol)
    print(f"cuda pool: written slots match the reference, untouched slots still NaN   "
          f"{'PASS' if pool_ok else 'FAIL'}")
    ok &= bool(pool_ok)
    return 0 if ok else 1


def add_selfcheck_arguments(parser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="random case")
    parser.add_argument("--backend", choices=["auto", "reference", "cuda"], default="auto",
                        help="auto: CUDA kernels when a GPU exists, else the references only")


def run_selfcheck(args) -> int:
    return main(seed=args.seed, backend=args.backend)
