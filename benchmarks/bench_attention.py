"""Paged attention (pagedkv) against FlashInfer 0.7.2, side by side in one process, same K/V values.

Decode: H=32, KVH=8, D=128, bf16, the 12 shapes of ../shared/ANCHORS.md (pages of 16 and 64 tokens; batch x
cache length 1x32K, 1x128K, 16x8K, 64x4K, 128x2K, 256x1K), pages shuffled. Ours reads its HND pool through the
block table; the peers read their own NHD copy of the same values: ``tc_fa2`` =
``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, backend="fa2")`` and ``xqa`` =
``trtllm_batch_decode_with_kv_cache(backend="xqa")`` (TensorRT-LLM's XQA kernel), the two best decode paths of
0.7.2 (ANCHORS.md; its CUDA-core decode, the 0.6.0 comparison, is ``--peers fa2``). Extra rows: our fp8 e4m3
cache at 64x4K against xqa's fp8 decode (and our bf16), and the TensorRT plugin's loose bounds
(max_q_len = T, max_kv_len = MB * page_size) at 64x4K and 256x1K.
Prefill: 4 sequences x a 2048-token chunk over 8192 cached tokens and 1 x 8192 over nothing (causal), against
``BatchPrefillWithPagedKVCacheWrapper(backend="fa3")`` (and fa2 with ``--peers``). ``--peers fa3_ragged`` adds a
reference, not a peer: ``BatchPrefillWithRaggedKVCacheWrapper(backend="fa3")`` on a contiguous copy of the same K/V,
whose loads are TMA tiles where the paged fa3 gathers rows by cp.async -- what the same family of kernel reaches
without a page table, kept out of the best-peer ratio (it solves an easier problem). Each bf16 prefill also times our
other multi-token kernels on the same tensors (the Hopper kernel's cooperative variant and the mma.sync kernel,
``PAGEDKV_MULTI_KERNEL``), and P16 an fp8 e4m3 cache on all three, beside the paged peers on the same fp8 values
(FlashInfer's paths for bf16 queries over an fp8 cache; one it lacks reports its failure in the note).
Llama-3 shapes (``llama``, in the default cases): decode P16 64x4K and both prefills (P16) at 64 query heads over 8
KV heads (70B-like) and at the default 32 / 8 (8B-like), D = 128, against the same peers.
Decode widths (``--cases widths``): P16 batches around the plan's CTA-width switch points, ours as planned and at
each width forced through ``PAGEDKV_DECODE_WARPS`` (the note has each width's time, split and ratio), no peers.
Decode splits (``--cases splits``): the batches the plan splits or runs as one wave (1x32K, 1x128K, 4x16K, 8x8K,
12x8K, 16x8K; P16 and P64), ours as planned, then at each width the split forced through ``PAGEDKV_DECODE_CHUNKS``
over the chunk counts worth timing (``split_counts``): a row per width with its fastest count, every count's time and
the largest max |forced - planned| in the note, no peers. What it asks: whether a split the model never picks (more
waves of shorter CTAs, which the hardware balances) beats the one-wave plans where xqa ties us.
Head dims (``--cases headdim``): decode P16 64x4K and prefill P16 4x2048 over 8192 at D = 64 (Llama-3.2-1B), 80
(Phi-2), 96 (Phi-3-mini) and 256 (Gemma), same H and KVH, each row's note with its time relative to ours at D = 128
(the decode / prefill row of the same run, or timed for the purpose when those cases did not run); the peers are
tried at those head dims too (a peer without a kernel for them reports its failure in the note); ``--head-dims`` picks a
subset. Not in the default cases: FlashInfer may JIT-compile (or refuse) these head dims, so .ci/gpu-run.sh runs them
on their own, under their own timeout.

Timing: median of ``triton.testing.do_bench`` (L2 flushed between repetitions) after warm-up, plain launches
(no CUDA graphs: both libraries pay their Python launch cost, hidden behind the GPU time for these sizes).
Bytes count each KV element read once (decode); TB/s = bytes / time; %4.28 is of the H200's 4.28 TB/s copy ceiling
(ANCHORS.md), %card of this card's, measured first in the same process (the two "ceiling" rows: a 4 GiB bf16 copy,
read + write counted, and a read-only sum over it): an H100 copies at ~3 TB/s, so only %card reads alike on both.
Prefill TFLOP/s counts 4*H*D (the row's H) per attended (query, key) pair. Each row names the best peer and "best/ours" (its
time over ours: > 1 means ours is faster); the note has every peer's time, ratio and max |ours - peer|.
benchmarks/NOTES-attention.md has the byte counts, floors and predictions.

Run on the GPU machine from the repository root (pagedkv built, torch + triton, FlashInfer importable):
    python benchmarks/bench_attention.py [--json out.json] [--cases decode,fp8,plugin,prefill,llama,headdim] [--peers ...]
FlashInfer 0.7.2 compiles each kernel on first use (``.whl/flashinfer-env.sh`` sets its JIT up there).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

COPY_CEILING_TBS = 4.28
H, KVH, D = 32, 8, 128
HEAD_DIMS = (64, 80, 96, 256)  # --cases headdim: the 64x4K decode and the 4x2048-over-8192 prefill (P16) at these D
DECODE_SHAPES = [(1, 32768), (1, 131072), (16, 8192), (64, 4096), (128, 2048), (256, 1024)]
# --cases widths: batches around the decode plan's CTA-width switch points (attention_plan.cpp, chooseDecodeWidth)
WIDTH_SWEEP_SHAPES = [(1, 32768), (4, 16384), (8, 8192), (12, 8192), (16, 8192), (24, 8192), (32, 4096), (48, 4096),
                      (64, 4096), (80, 4096), (96, 2048), (128, 2048), (192, 2048), (256, 1024), (512, 512)]
# --cases splits: the batches the decode plan splits, or runs as one wave of 8-warp CTAs, and the forced chunk counts
SPLIT_SWEEP_SHAPES = [(1, 32768), (1, 131072), (4, 16384), (8, 8192), (12, 8192), (16, 8192)]
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 11, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
PREFILLS = [dict(num_seqs=4, chunk=2048, cached=8192), dict(num_seqs=1, chunk=8192, cached=0)]
LLAMA_HEADS = ((64, 8), (32, 8))  # --cases llama: (query heads, KV heads) of Llama-3-70B and -8B
DEFAULT_PEERS = ("tc_fa2", "xqa", "fa3")
# fa2: CUDA-core decode; fa2_prefill / fa3: prefill backends; fa3_ragged: fa3 on contiguous K/V (a reference)
PEERS = ("fa2", "tc_fa2", "xqa", "fa2_prefill", "fa3", "fa3_ragged")
REFERENCES = ("fa3_ragged",)  # timed beside the peers, never the row's best peer: contiguous K/V, no page table


@dataclass
class Result:
    case: str
    impl: str
    us: float
    tbs: float | None = None         # decode: KV bytes / time
    pct_ceiling: float | None = None  # of COPY_CEILING_TBS (the H200's)
    pct_card: float | None = None     # of this card's copy rate, measured in the same run
    tflops: float | None = None      # prefill
    best_peer: str | None = None     # the fastest FlashInfer path on this row
    best_peer_us: float | None = None
    best_over_ours: float | None = None  # best peer time / our time: > 1 -> ours faster
    peers_us: dict | None = None     # every peer timed on this row
    note: str = ""


class Step:
    """One step on the GPU (torch tensors): shuffled block table, our HND pool, queries, our launch args."""

    def __init__(self, torch, *, num_seqs: int, q_len: int, past_len: int, page_size: int, cache: str = "bf16",
                 head_dim: int = D, num_q_heads: int = H, num_kv_heads: int = KVH, seed: int = 0):
        from pagedkv.config import AttentionConfig, PoolConfig
        from pagedkv.layout import CacheDType

        self.torch = torch
        self.num_seqs, self.q_len, self.past_len, self.page_size = num_seqs, q_len, past_len, page_size
        self.head_dim, self.h, self.kvh = head_dim, num_q_heads, num_kv_heads
        self.kv_len = past_len + q_len
        self.tokens = num_seqs * q_len
        self.pages = -(-self.kv_len // page_size)
        self.num_blocks = num_seqs * self.pages
        g = torch.Generator(device="cuda").manual_seed(seed)
        perm = torch.randperm(self.num_blocks, device="cuda", generator=g).to(torch.int32)
        self.block_table = perm.view(num_seqs, self.pages).contiguous()
        self.cu_q_lens = torch.arange(num_seqs + 1, device="cuda", dtype=torch.int32) * q_len
        self.past_lens = torch.full((num_seqs,), past_len, device="cuda", dtype=torch.int32)
        self.q = torch.randn(self.tokens, num_q_heads * head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        self.cache = cache
        cache_dtype = {"bf16": CacheDType.BF16, "fp8": CacheDType.FP8_E4M3}[cache]
        self.cfg = AttentionConfig(num_q_heads=num_q_heads, pool=PoolConfig(
            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, num_layers=1, layer_index=0, cache_dtype=cache_dtype,
            k_scale=1.0, v_scale=1.0))
        shape = self.cfg.pool.layout().pool_shape(self.num_blocks)  # HND [NB, 1, 2, KVH, P, D]
        # Every slot holds a value (positions past a sequence's end included): N(0, 1) in the cache dtype.
        self.pool = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        if cache == "fp8":
            self.pool = self.pool.to(torch.float8_e4m3fn)
        self.descs = torch.tensor([[self.pool.data_ptr(), self.num_blocks, 0, 0]], device="cuda", dtype=torch.int64)
        self.out = torch.empty(self.tokens, num_q_heads * head_dim, device="cuda", dtype=torch.bfloat16)

    @property
    def kv_bytes(self) -> int:
        return self.num_seqs * self.kv_len * self.kvh * self.head_dim * 2 * (2 if self.cache == "bf16" else 1)

    @property
    def attended_pairs(self) -> int:
        # causal: query i of a sequence sees past_len + i + 1 keys
        return self.num_seqs * (self.q_len * self.past_len + self.q_len * (self.q_len + 1) // 2)

    @property
    def flops(self) -> int:
        return 4 * self.h * self.head_dim * self.attended_pairs

    def our_launcher(self, *, plugin_bounds: bool = False):
        """Zero-argument launch of our kernels on torch's current stream, with the workspace it needs."""
        from pagedkv.kernels import attention as A

        torch = self.torch
        max_q = self.tokens if plugin_bounds else self.q_len
        max_kv = self.pages * self.page_size if plugin_bounds else self.kv_len
        ws_bytes = A.attention_workspace_bytes(self.tokens, self.num_seqs, self.h, self.head_dim, max_kv, self.page_size)
        ws = torch.empty(max(ws_bytes, 16), device="cuda", dtype=torch.uint8)
        args = A.attention_params(
            self.cfg, io_dtype=A.IODType.BF16, num_tokens=self.tokens, num_seqs=self.num_seqs, max_blocks=self.pages,
            max_q_len=max_q, max_kv_len=max_kv, q=self.q.data_ptr(), out=self.out.data_ptr(),
            pool_descs=self.descs.data_ptr(), block_table=self.block_table.data_ptr(),
            cu_q_lens=self.cu_q_lens.data_ptr(), past_lens=self.past_lens.data_ptr(), workspace=ws.data_ptr(),
            workspace_bytes=ws_bytes)
        lib = A._capi()
        plan = A.device_plan(args)  # what the launches below run (the decode width, the split) on this GPU

        def launch():
            rc = lib.pagedkv_attention(ctypes.byref(args), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
            if rc != 0:
                raise RuntimeError(f"pagedkv_attention: {rc}: {lib.pagedkv_last_error().decode()}")

        launch.keep = (ws, args)  # alive as long as the launcher
        launch.plan = plan
        return launch

    def flashinfer_layout(self):
        """FlashInfer's own NHD copy of the same K/V values: [NB, 2, P, KVH, D], and its page-table triple."""
        torch = self.torch
        kv = self.pool[:, 0].permute(0, 1, 3, 2, 4).contiguous()  # [NB, 2, KVH, P, D] -> [NB, 2, P, KVH, D]
        indices = self.block_table.reshape(-1).contiguous()
        indptr = torch.arange(self.num_seqs + 1, device="cuda", dtype=torch.int32) * self.pages
        last = torch.full((self.num_seqs,), self.kv_len - (self.pages - 1) * self.page_size, device="cuda",
                          dtype=torch.int32)
        return kv, indptr, indices, last


class Peers:
    """FlashInfer's paged decode and prefill paths on a step's own K/V values (its NHD copy), one launcher each."""

    def __init__(self, torch, flashinfer):
        import flashinfer.decode  # noqa: F401 - trtllm_batch_decode_with_kv_cache (xqa) lives there

        self.torch, self.fi = torch, flashinfer
        self.workspace = torch.empty(512 << 20, device="cuda", dtype=torch.uint8)  # fa2/fa3 wrappers
        self.xqa_workspace = torch.zeros(256 << 20, device="cuda", dtype=torch.uint8)  # XQA: semaphores start zeroed

    def decode(self, step: Step, peer: str):
        torch, fi = self.torch, self.fi
        kv, indptr, indices, last = step.flashinfer_layout()
        head_dim = step.head_dim
        q = step.q.view(step.tokens, step.h, head_dim)
        out = torch.empty_like(q)
        if peer == "xqa":
            block_tables = step.block_table
            seq_lens = torch.full((step.num_seqs,), step.kv_len, device="cuda", dtype=torch.int32)

            def launch():
                return fi.decode.trtllm_batch_decode_with_kv_cache(
                    query=q, kv_cache=kv, workspace_buffer=self.xqa_workspace, block_tables=block_tables,
                    seq_lens=seq_lens, max_seq_len=step.kv_len, bmm1_scale=1.0 / math.sqrt(head_dim), bmm2_scale=1.0,
                    out=out, kv_layout="NHD", backend="xqa")
            launch.keep = (kv, block_tables, seq_lens, out)
            return launch
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=(peer == "tc_fa2"),
                                                        backend="fa2")
        wrapper.plan(indptr, indices, last, step.h, step.kvh, head_dim, step.page_size, q_data_type=torch.bfloat16,
                     kv_data_type=kv.dtype, o_data_type=torch.bfloat16)

        def launch():
            return wrapper.run(q, kv, out=out)
        launch.keep = (kv, indptr, indices, last, wrapper, out)
        return launch

    def prefill(self, step: Step, peer: str):
        torch = self.torch
        kv, indptr, indices, last = step.flashinfer_layout()
        if peer == "fa3_ragged":
            return self.prefill_ragged(step, kv)
        backend = {"fa2_prefill": "fa2", "fa3": "fa3"}[peer]
        wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=backend)
        wrapper.plan(step.cu_q_lens, indptr, indices, last, step.h, step.kvh, step.head_dim, step.page_size, causal=True,
                     q_data_type=torch.bfloat16, kv_data_type=kv.dtype)
        q = step.q.view(step.tokens, step.h, step.head_dim)

        def launch():
            return wrapper.run(q, kv)
        launch.keep = (kv, indptr, indices, last, wrapper)
        return launch

    def prefill_ragged(self, step: Step, kv):
        """fa3 on each sequence's K/V gathered into one contiguous [kv_len, KVH, D] run (the same values, in order)."""
        torch = self.torch
        pages = kv[step.block_table.long()]  # [B, pages, 2, P, KVH, D] in each sequence's logical order
        flat = pages.permute(0, 2, 1, 3, 4, 5).reshape(step.num_seqs, 2, step.pages * step.page_size, step.kvh,
                                                        step.head_dim)[:, :, :step.kv_len]
        k = flat[:, 0].reshape(-1, step.kvh, step.head_dim).contiguous()
        v = flat[:, 1].reshape(-1, step.kvh, step.head_dim).contiguous()
        kv_indptr = torch.arange(step.num_seqs + 1, device="cuda", dtype=torch.int32) * step.kv_len
        wrapper = self.fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa3")
        wrapper.plan(step.cu_q_lens, kv_indptr, step.h, step.kvh, step.head_dim, causal=True,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        q = step.q.view(step.tokens, step.h, step.head_dim)

        def launch():
            return wrapper.run(q, k, v)
        launch.keep = (k, v, kv_indptr, wrapper)
        return launch


def time_us(fn, torch, triton, rep: int = 100) -> float:
    fn()  # warm-up outside the timing: JIT, module loading, occupancy queries
    torch.cuda.synchronize()
    return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def card_ceilings(torch, triton) -> list[Result]:
    """This card's copy and read-only rates over 4 GiB of bf16 (ANCHORS.md's method), as two rows: the decode rows'
    %card is of the copy's."""
    src = torch.randn(2 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    rows = []
    for impl, fn, nbytes in (("torch copy_ (read + write)", lambda: dst.copy_(src), 2 * src.nbytes),
                             ("torch sum (read-only)", lambda: src.sum(dtype=torch.float32), src.nbytes)):
        us = time_us(fn, torch, triton)
        tbs = nbytes / (us * 1e-6) / 1e12
        rows.append(Result("ceiling 4 GiB bf16", impl, us, tbs, 100 * tbs / COPY_CEILING_TBS))
    for r in rows:
        r.pct_card = 100 * r.tbs / rows[0].tbs
    del src, dst
    torch.cuda.empty_cache()
    return rows


def decode_case(torch, batch: int, length: int, page: int) -> tuple[str, Step]:
    """A decode row's name and step (bf16 cache): `batch` sequences of `length` tokens, the last one the query."""
    return f"decode P{page} {batch}x{length}", Step(torch, num_seqs=batch, q_len=1, past_len=length - 1,
                                                    page_size=page, seed=batch + page)


def prefill_case(torch, shape: dict, page: int, cache: str = "bf16", head_dim: int = D) -> tuple[str, Step]:
    """A prefill row's name and step (a bf16 cache, or `cache`; D = 128, or `head_dim`) for one of PREFILLS."""
    name = f"prefill P{page} {shape['num_seqs']}x{shape['chunk']} over {shape['cached']}"
    if head_dim != D:
        name += f" D{head_dim}"
    if cache != "bf16":
        name += f" {cache} cache"
    return name, Step(torch, num_seqs=shape["num_seqs"], q_len=shape["chunk"], past_len=shape["cached"],
                      page_size=page, cache=cache, head_dim=head_dim, seed=7)


@contextlib.contextmanager
def launch_setting(name: str, value: str):
    """Launches inside run with the environment variable `name` (read by the launcher at every launch) set to
    `value`; its previous value is restored."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def multi_kernel(choice: str):
    """The multi-token kernel `choice` (PAGEDKV_MULTI_KERNEL: "mma" -- the sm_80 / sm_89 kernel, and the H200's
    before the wgmma one -- "sm90-cooperative" or "sm90-ws")."""
    return launch_setting("PAGEDKV_MULTI_KERNEL", choice)


def decode_warps(warps: int):
    """The decode kernel's CTA width (PAGEDKV_DECODE_WARPS: 2, 4 or 8 warps) instead of the plan's choice."""
    return launch_setting("PAGEDKV_DECODE_WARPS", str(warps))


def decode_chunks(chunks: int):
    """The decode split's chunk count (PAGEDKV_DECODE_CHUNKS) instead of the split model's choice."""
    return launch_setting("PAGEDKV_DECODE_CHUNKS", str(chunks))


def split_counts(batch: int, length: int, kv_heads: int = KVH) -> list[int]:
    """The forced decode chunk counts worth timing for `batch` sequences of `length` tokens: whole, or cut into at
    most the span's 256-token chunks (the plan's floor) with at least half a wave of the widest CTAs (66 on 132 SMs)
    and at most 4096 CTAs."""
    units = batch * kv_heads
    return [n for n in SPLIT_COUNTS if n == 1 or (n <= length // 256 and 66 <= units * n <= 4096)]


def plan_note(plan: dict) -> str:
    return f"[split {plan['decode_grid'][2]}, {plan['decode_warps']} warps]"


def max_diff(ours_out, theirs_out) -> float:
    return (ours_out.float().view(-1) - theirs_out.float().reshape(-1)).abs().max().item()


def run(which: set[str], peers: tuple[str, ...], head_dims: tuple[int, ...] = HEAD_DIMS) -> list[Result]:
    import torch
    import triton

    from _bench_common import import_flashinfer

    from pagedkv.kernels.attention import DECODE_WIDTHS

    flashinfer, fi_error = import_flashinfer()
    lib = Peers(torch, flashinfer) if flashinfer is not None else None
    results: list[Result] = card_ceilings(torch, triton)
    card_tbs = results[0].tbs  # the copy's

    def time_peers(step: Step, ours, kind: str, names, flops=None):
        """Each peer's median time and a note with its ratio to ours, its max |ours - peer| (and TFLOP/s)."""
        times, notes = {}, []
        for peer in names:
            if lib is None:
                notes.append(f"{peer}: FlashInfer unavailable ({fi_error})")
                continue
            try:
                fn = getattr(lib, kind)(step, peer)
                peer_us = time_us(fn, torch, triton)
                ours()
                diff = max_diff(step.out, fn())
            except Exception as exc:  # noqa: BLE001 - one failing peer config must not stop the benchmark
                notes.append(f"{peer} failed: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            times[peer] = peer_us
            rate = f", {flops / (peer_us * 1e-6) / 1e12:.0f} TFLOP/s" if flops else ""
            notes.append(f"{peer} {peer_us:.1f} us{rate} (x{peer_us / ours.us:.2f}, max|diff| {diff:.4f})")
        return times, notes

    def row(case, impl, step, ours, us, times, notes, *, tbs=None, tflops=None, extra=""):
        ranked = {peer: t for peer, t in times.items() if peer not in REFERENCES}
        best = min(ranked, key=ranked.get) if ranked else None
        results.append(Result(case, impl, us, tbs, 100 * tbs / COPY_CEILING_TBS if tbs else None,
                              100 * tbs / card_tbs if tbs else None, tflops, best, times[best] if best else None,
                              times[best] / us if best else None, times or None,
                              "; ".join(notes + ([extra] if extra else []))))

    decode_peers = [p for p in peers if p in ("fa2", "tc_fa2", "xqa")]
    if "decode" in which or "fp8" in which or "plugin" in which:
        for page in (16, 64):
            for batch, length in DECODE_SHAPES:
                need = "decode" in which or (("fp8" in which or "plugin" in which) and (batch, length) == (64, 4096)) \
                    or ("plugin" in which and (batch, length) == (256, 1024) and page == 16)
                if not need:
                    continue
                name, step = decode_case(torch, batch, length, page)
                ours = step.our_launcher()
                us = ours.us = time_us(ours, torch, triton)
                times, notes = time_peers(step, ours, "decode", decode_peers)
                tbs = step.kv_bytes / (us * 1e-6) / 1e12
                row(name, "pagedkv bf16", step, ours, us, times, notes, tbs=tbs, extra=plan_note(ours.plan))
                bf16_us = us
                if "plugin" in which and (batch, length) in ((64, 4096), (256, 1024)) and page == 16:
                    loose = step.our_launcher(plugin_bounds=True)
                    us = time_us(loose, torch, triton)
                    row(name, "pagedkv bf16, plugin bounds", step, loose, us, times, [],
                        tbs=step.kv_bytes / (us * 1e-6) / 1e12,
                        extra=f"runs multi-token kernel too: {bool(loose.plan['run_multi'])}")
                del step
                if "fp8" in which and (batch, length) == (64, 4096):
                    step = Step(torch, num_seqs=batch, q_len=1, past_len=length - 1, page_size=page, cache="fp8")
                    ours = step.our_launcher()
                    us = ours.us = time_us(ours, torch, triton)
                    times, notes = time_peers(step, ours, "decode", [p for p in decode_peers if p == "xqa"])
                    row(name, "pagedkv fp8 e4m3 cache", step, ours, us, times, notes,
                        tbs=step.kv_bytes / (us * 1e-6) / 1e12, extra=f"{bf16_us / us:.2f}x faster than our bf16")
                    del step
                torch.cuda.empty_cache()

    if "widths" in which:
        # The decode CTA widths on batches around the plan's switch points (P16, bf16): ours as planned and at each
        # width forced (PAGEDKV_DECODE_WARPS), no peers (the decode rows have them).
        for batch, length in WIDTH_SWEEP_SHAPES:
            step = Step(torch, num_seqs=batch, q_len=1, past_len=length - 1, page_size=16, seed=batch + 1)
            ours = step.our_launcher()
            us = ours.us = time_us(ours, torch, triton)
            forced = []
            for warps in DECODE_WIDTHS:
                with decode_warps(warps):
                    try:
                        other = step.our_launcher()
                        other_us = time_us(other, torch, triton)
                    except Exception as exc:  # noqa: BLE001 - a width this GPU cannot host is a note, not a stop
                        forced.append(f"{warps} warps: {type(exc).__name__}: {str(exc)[:80]}")
                        continue
                forced.append(f"{warps} warps {other_us:.1f} us (x{other_us / us:.3f}) {plan_note(other.plan)}")
            row(f"decode widths P16 {batch}x{length}", "pagedkv bf16, planned width", step, ours, us, {}, forced,
                tbs=step.kv_bytes / (us * 1e-6) / 1e12, extra=plan_note(ours.plan))
            del step
            torch.cuda.empty_cache()

    if "splits" in which:
        # The decode split forced (PAGEDKV_DECODE_CHUNKS) at each width (PAGEDKV_DECODE_WARPS): ours as planned, then a
        # row per width with its fastest chunk count (the count the grid really has), no peers.
        for page in (16, 64):
            for batch, length in SPLIT_SWEEP_SHAPES:
                name, step = decode_case(torch, batch, length, page)
                name = name.replace("decode", "decode splits")
                ours = step.our_launcher()
                us = ours.us = time_us(ours, torch, triton)
                row(name, "pagedkv bf16, planned", step, ours, us, {}, [], tbs=step.kv_bytes / (us * 1e-6) / 1e12,
                    extra=plan_note(ours.plan))
                ours()
                planned_out = step.out.clone()
                for warps in DECODE_WIDTHS:
                    timed, notes, worst = {}, [], 0.0
                    with decode_warps(warps):
                        for n in split_counts(batch, length):
                            with decode_chunks(n):
                                try:
                                    forced = step.our_launcher()
                                    forced_us = time_us(forced, torch, triton)
                                    forced()
                                except Exception as exc:  # noqa: BLE001 - a width this GPU cannot host is a note
                                    notes.append(f"{warps} warps, {n} chunks: {type(exc).__name__}: {str(exc)[:80]}")
                                    break
                            worst = max(worst, max_diff(step.out, planned_out))
                            timed.setdefault(forced.plan["decode_grid"][2], forced_us)
                    if not timed:
                        results.append(Result(name, f"pagedkv bf16, {warps} warps", math.nan, note="; ".join(notes)))
                        continue
                    best = min(timed, key=timed.get)
                    every = " ".join(f"{n}:{t:.1f}" for n, t in sorted(timed.items()))
                    row(name, f"pagedkv bf16, {warps} warps, best split", step, None, timed[best], {},
                        notes + [f"chunks:us {every}", f"max|forced - planned| {worst:.4f}"],
                        tbs=step.kv_bytes / (timed[best] * 1e-6) / 1e12,
                        extra=f"[split {best}, {warps} warps] x{timed[best] / us:.3f} of planned")
                del step
                torch.cuda.empty_cache()

    prefill_peers = [p for p in peers if p in ("fa2_prefill", "fa3", "fa3_ragged")]
    if "prefill" in which:
        for shape in PREFILLS:
            for page in (16, 64):
                name, step = prefill_case(torch, shape, page)
                flops = step.flops
                ours = step.our_launcher()
                us = ours.us = time_us(ours, torch, triton)
                times, notes = time_peers(step, ours, "prefill", prefill_peers, flops)
                row(name, "pagedkv bf16", step, ours, us, times, notes, tflops=flops / (us * 1e-6) / 1e12)
                # The other multi-token kernels on the same tensors, and how far their output is from the default's.
                ours()
                default_out = step.out.clone()
                for choice, label in (("sm90-cooperative", "Hopper cooperative"), ("mma", "mma.sync")):
                    with multi_kernel(choice):
                        other = step.our_launcher()
                        other_us = time_us(other, torch, triton)
                        other()
                    diff = max_diff(default_out, step.out)
                    row(name, f"pagedkv bf16, {label} kernel", step, other, other_us, times, [],
                        tflops=flops / (other_us * 1e-6) / 1e12,
                        extra=f"default kernel {other_us / us:.2f}x faster; max|diff| to the default {diff:.4f}")
                del step
                if page == 16:  # an fp8 e4m3 cache: 8-bit tiles converted in shared memory by either kernel
                    step = prefill_case(torch, shape, page, cache="fp8")[1]
                    fp8 = step.our_launcher()
                    fp8_us = fp8.us = time_us(fp8, torch, triton)
                    # the paged peers on the same fp8 values (a path FlashInfer lacks for bf16 queries is a note)
                    fp8_times, fp8_notes = time_peers(step, fp8, "prefill",
                                                      [p for p in prefill_peers if p not in REFERENCES], flops)
                    others = []
                    for choice, label in (("sm90-cooperative", "Hopper cooperative"), ("mma", "mma.sync")):
                        with multi_kernel(choice):
                            other_us = time_us(step.our_launcher(), torch, triton)
                        others.append(f"{label} kernel {other_us:.1f} us ({other_us / fp8_us:.2f}x)")
                    row(name, "pagedkv fp8 e4m3 cache", step, fp8, fp8_us, fp8_times, fp8_notes,
                        tflops=flops / (fp8_us * 1e-6) / 1e12, extra="; ".join(others) + f"; bf16 {us:.1f} us")
                    del step
                torch.cuda.empty_cache()

    if "headdim" in which:
        def d128_us(case: str, make) -> float:
            # The D = 128 row of this run, or (headdim alone) ours timed at D = 128 here, without peers.
            found = next((r.us for r in results if r.case == case and r.impl == "pagedkv bf16"), None)
            if found is None:
                step = make(D)
                ours = step.our_launcher()
                found = time_us(ours, torch, triton)
                row(case, "pagedkv bf16", step, ours, found, {}, ["D = 128 reference for the head-dim rows"])
                del step
            return found

        def decode_step(d):
            return Step(torch, num_seqs=64, q_len=1, past_len=4095, page_size=16, head_dim=d, seed=80 + d)

        def prefill_step(d):
            return prefill_case(torch, PREFILLS[0], 16, head_dim=d)[1]

        base_decode = d128_us("decode P16 64x4096", decode_step)
        base_prefill = d128_us("prefill P16 4x2048 over 8192", prefill_step)
        for d in head_dims:
            step = decode_step(d)
            ours = step.our_launcher()
            us = ours.us = time_us(ours, torch, triton)
            times, notes = time_peers(step, ours, "decode", decode_peers)
            row(f"decode P16 64x4096 D{d}", "pagedkv bf16", step, ours, us, times, notes,
                tbs=step.kv_bytes / (us * 1e-6) / 1e12,
                extra=f"{plan_note(ours.plan)} {us / base_decode:.2f}x the D = 128 time")
            del step
            step = prefill_step(d)
            flops = step.flops
            ours = step.our_launcher()
            us = ours.us = time_us(ours, torch, triton)
            times, notes = time_peers(step, ours, "prefill", prefill_peers, flops)
            row(f"prefill P16 4x2048 over 8192 D{d}", "pagedkv bf16", step, ours, us, times, notes,
                tflops=flops / (us * 1e-6) / 1e12, extra=f"{us / base_prefill:.2f}x the D = 128 time")
            del step
            torch.cuda.empty_cache()

    if "llama" in which:
        # Llama-3-70B-like (64 query heads over 8 KV heads, G = 8) beside the 8B-like default (32 / 8), D = 128.
        for h, kvh in LLAMA_HEADS:
            tag = f"H{h}/{kvh}"
            step = Step(torch, num_seqs=64, q_len=1, past_len=4095, page_size=16, num_q_heads=h, num_kv_heads=kvh,
                        seed=70)
            ours = step.our_launcher()
            us = ours.us = time_us(ours, torch, triton)
            times, notes = time_peers(step, ours, "decode", decode_peers)
            row(f"decode P16 64x4096 {tag}", "pagedkv bf16", step, ours, us, times, notes,
                tbs=step.kv_bytes / (us * 1e-6) / 1e12, extra=plan_note(ours.plan))
            del step
            for shape in PREFILLS:
                step = Step(torch, num_seqs=shape["num_seqs"], q_len=shape["chunk"], past_len=shape["cached"],
                            page_size=16, num_q_heads=h, num_kv_heads=kvh, seed=71)
                ours = step.our_launcher()
                us = ours.us = time_us(ours, torch, triton)
                times, notes = time_peers(step, ours, "prefill", prefill_peers, step.flops)
                row(f"prefill P16 {shape['num_seqs']}x{shape['chunk']} over {shape['cached']} {tag}", "pagedkv bf16",
                    step, ours, us, times, notes, tflops=step.flops / (us * 1e-6) / 1e12)
                del step
            torch.cuda.empty_cache()
    return results


def print_table(results: list[Result]) -> None:
    header = (f"{'case':<34} {'implementation':<30} {'us':>9} {'TB/s':>6} {'%4.28':>6} {'%card':>6} {'TFLOP/s':>8} "
              f"{'best peer':>9} {'peer us':>9} {'best/ours':>9}  note")
    print(header)
    print("-" * len(header))

    def f(x, fmt):
        return format(x, fmt) if x is not None else "-"

    for r in results:
        print(f"{r.case:<34} {r.impl:<30} {r.us:9.1f} {f(r.tbs, '6.2f'):>6} {f(r.pct_ceiling, '6.1f'):>6} "
              f"{f(r.pct_card, '6.1f'):>6} "
              f"{f(r.tflops, '8.0f'):>8} {r.best_peer or '-':>9} {f(r.best_peer_us, '9.1f'):>9} "
              f"{f(r.best_over_ours, '9.2f'):>9}  {r.note}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--cases", default="decode,fp8,plugin,prefill,llama",
                    help="comma-separated subset of: decode, fp8, plugin, prefill, headdim, llama, widths, splits")
    ap.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)),
                    help="--cases headdim: comma-separated subset of %(default)s (a peer's JIT build per head dim "
                         "costs tens of seconds on the device)")
    ap.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                    help=f"comma-separated FlashInfer paths to time, of: {', '.join(PEERS)} (default %(default)s)")
    args = ap.parse_args()
    which = set(args.cases.split(","))
    unknown = which - {"decode", "fp8", "plugin", "prefill", "headdim", "llama", "widths", "splits"}
    if unknown:
        ap.error(f"--cases: unknown {sorted(unknown)}")
    try:
        head_dims = tuple(int(d) for d in args.head_dims.split(",") if d)
    except ValueError:
        ap.error(f"--head-dims={args.head_dims!r}: expected integers from {', '.join(map(str, HEAD_DIMS))}")
    if not head_dims or set(head_dims) - set(HEAD_DIMS):
        ap.error(f"--head-dims={args.head_dims!r}: expected a non-empty subset of {', '.join(map(str, HEAD_DIMS))}")
    peers = tuple(p for p in args.peers.split(",") if p)
    if set(peers) - set(PEERS):
        ap.error(f"--peers: unknown {sorted(set(peers) - set(PEERS))}")
    t0 = time.time()
    results = run(which, peers, head_dims)
    print_table(results)
    print(f"\n{len(results)} rows in {time.time() - t0:.0f} s; reproduce: python benchmarks/bench_attention.py "
          f"--cases {args.cases} --peers {args.peers}" + (f" --head-dims {args.head_dims}" if "headdim" in which else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0 if all(math.isfinite(r.us) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
