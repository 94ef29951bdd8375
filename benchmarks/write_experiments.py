"""Experiments behind NOTES-write.md rounds 5 and 6 (not a product benchmark; bench_write.py is): what bounds the
16K-token bf16 prefill of the fused QKV write.

  --what copy      the kernel's byte stream without its arithmetic: 201 MB of packed qkv read in 512-byte warp
                   passes (24 per token, balanced warp ranges, 3 CTAs x 8 warps per SM), written straight back
                   ("copy") or where the kernel writes them ("dest": q rows contiguous, K and V head rows into
                   shuffled HND pages of 16 tokens), brought in by the kernel's cp.async ring (depths 4 / 6 / 8);
                   the same stream at 4 / 6 / 8 CTAs per SM, in token order (warps take whole tokens round-robin,
                   the grid sweeping the tensors together), through registers instead of shared memory, and as
                   torch's flat grid of short CTAs; on sm_90 also through a per-warp ring of bulk copies (stages x
                   bytes); torch's copy_ of the same bytes last. NVRTC (cuda-python) compiles the walks for the GPU
                   at hand.
  --what ablation  our kernel (bf16 HND, P16 and P64) with RoPE off, GPT-J, explicit positions and an fp8 cache,
                   each alone and as the second of two launches in one graph (warm constant / instruction caches).
  --what prefill   our kernel alone on bench_write.py's prefill cases (no peer): for comparing builds.
  --profile-once   two launches of the bench's case (1 x 16384, P16) for Nsight Compute:
                   ncu --clock-control none --set full --launch-skip 1 --launch-count 1 -k regex:qkvWrite ...

Run on the GPU machine from the repository root (pagedkv installed; torch, triton, cuda-bindings).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_write as bw  # noqa: E402

WALK_SOURCE = r"""
template <bool kKernelDestinations>
__device__ char* destination(char* dst, char* pool, const int* perm, long long c, int lane);
// Warp w's share of the chunks: kTokenOrder = false, balanced contiguous ranges (the kernel's order); true, whole
// tokens (24 chunks) round-robin (tokens w, w + W, ...), so that the grid sweeps the tensors together instead of
// in ~3000 separate ranges.
template <bool kTokenOrder>
__device__ void warpShare(long long w, long long chunks, int warps, long long& first, long long& count) {
    first = 0, count = 0;
    if (w >= warps) return;
    if (kTokenOrder) {
        long long const tokens = chunks / 24;
        count = (tokens > w ? (tokens - w + warps - 1) / warps : 0) * 24;
        first = w;
    } else {
        first = w * chunks / warps;
        count = (w + 1) * chunks / warps - first;
    }
}
// The i-th chunk of the share.
template <bool kTokenOrder>
__device__ long long chunkOf(long long first, long long i, int warps) {
    return kTokenOrder ? (first + (i / 24) * warps) * 24 + i % 24 : first + i;
}
template <int kDepth, bool kKernelDestinations, bool kTokenOrder = false>
__device__ void walk(const char* __restrict__ src, char* __restrict__ dst, char* __restrict__ pool,
                     const int* __restrict__ perm, long long chunks, int warps) {
    constexpr int kSlots = kDepth + 1;
    __shared__ __align__(16) unsigned char ring[kSlots][256][16];
    int const lane = threadIdx.x & 31;
    long long const w = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    long long first, count;
    warpShare<kTokenOrder>(w, chunks, warps, first, count);
    unsigned const column = (unsigned)__cvta_generic_to_shared(&ring[0][threadIdx.x][0]);
    long long ahead = 0;
    auto const issue = [&](int slot, bool valid) {
        const char* const from = valid ? src + chunkOf<kTokenOrder>(first, ahead, warps) * 512 + 16 * lane : src;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(column + slot * 4096), "l"(from),
                     "r"(valid ? 16 : 0) : "memory");
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        ++ahead;
    };
#pragma unroll
    for (int k = 0; k < kDepth; ++k) issue(k, k < count);
    int slot = 0;
    for (long long i = 0; i < count; ++i) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(kDepth - 1) : "memory");
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(column + slot * 4096) : "memory");
        issue(slot == 0 ? kDepth : slot - 1, i + kDepth < count);
        long long const c = chunkOf<kTokenOrder>(first, i, warps);
        *reinterpret_cast<uint4*>(destination<kKernelDestinations>(dst, pool, perm, c, lane)) = v;
        slot = slot == kDepth ? 0 : slot + 1;
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
// Register loads instead of the shared-memory ring: kUnroll passes loaded (ld.global.nc, no L1 allocation), then
// stored, per iteration, over the kernel's contiguous warp ranges.
template <int kUnroll>
__device__ void walkRegs(const char* __restrict__ src, char* __restrict__ dst, long long chunks, int warps) {
    int const lane = threadIdx.x & 31;
    long long const w = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    long long first, count;
    warpShare<false>(w, chunks, warps, first, count);
    for (long long i = 0; i < count; i += kUnroll) {
        uint4 v[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
            if (i + k < count)
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                             : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w)
                             : "l"(src + (first + i + k) * 512 + 16 * lane));
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
            if (i + k < count) *reinterpret_cast<uint4*>(dst + (first + i + k) * 512 + 16 * lane) = v[k];
    }
}
// Where chunk c's 16 bytes of this lane go: straight back (copy) or where the kernel writes them.
template <bool kKernelDestinations>
__device__ char* destination(char* dst, char* pool, const int* perm, long long c, int lane) {
    char* to = dst + c * 512 + 16 * lane;
    if (kKernelDestinations) {  // token t = c / 24, pass p: Q rows 0..31 (p < 16), K 32..39, V 40..47
        long long const t = c / 24;
        int const p = (int)(c - t * 24);
        if (p < 16) {
            to = dst + t * 8192 + p * 512 + 16 * lane;
        } else {
            int const kv = p >= 20;
            int const head = ((p - 16 - 4 * kv) << 1) + (lane >> 4);
            to = pool + (long long)perm[t >> 4] * 65536 + kv * 32768 + head * 4096 + (t & 15) * 256 +
                 16 * (lane & 15);
        }
    }
    return to;
}
#define WALK(D, K, NAME) extern "C" __global__ void __launch_bounds__(256, 3) NAME(const char* s, char* d, \
    char* pl, const int* pm, long long n, int w) { walk<D, K>(s, d, pl, pm, n, w); }
WALK(4, false, copy_4) WALK(6, false, copy_6) WALK(8, false, copy_8)
WALK(4, true, dest_4) WALK(6, true, dest_6) WALK(8, true, dest_8)
// The stream's other shapes: more CTAs per SM (launch bounds; the grid fills them), token order, register loads.
#define WALK_AT(D, CTAS, ORDER, NAME) extern "C" __global__ void __launch_bounds__(256, CTAS) NAME(const char* s, \
    char* d, char* pl, const int* pm, long long n, int w) { walk<D, true, ORDER>(s, d, pl, pm, n, w); }
WALK_AT(4, 4, false, dest_4_at4) WALK_AT(4, 6, false, dest_4_at6) WALK_AT(4, 8, false, dest_4_at8)
WALK_AT(4, 3, true, dest_4_tokens) WALK_AT(4, 6, true, dest_4_tokens_at6)
#define REGS(U, CTAS, NAME) extern "C" __global__ void __launch_bounds__(256, CTAS) NAME(const char* s, char* d, \
    char* pl, const int* pm, long long n, int w) { walkRegs<U>(s, d, n, w); }
REGS(4, 3, regs_4) REGS(8, 3, regs_8) REGS(4, 6, regs_4_at6)
// torch's copy_ shape: a grid of short CTAs of 128 threads, each thread 4 loads of 16 bytes, then their stores.
extern "C" __global__ void __launch_bounds__(128) flat_copy(const char* s, char* d, char* pl, const int* pm,
                                                            long long n, int w) {
    long long const base = ((long long)blockIdx.x * 512 + threadIdx.x) * 16;
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
        if (base + k * 2048 < n * 512) v[k] = *reinterpret_cast<const uint4*>(s + base + k * 2048);
#pragma unroll
    for (int k = 0; k < 4; ++k)
        if (base + k * 2048 < n * 512) *reinterpret_cast<uint4*>(d + base + k * 2048) = v[k];
}

// The input ring of round 6's dropped sm_90 BulkRowRing: the warp's range is one byte stream, brought in by lane 0
// in bulk copies of kStageBytes into a ring of kStages, each completing on its mbarrier; lanes wait for their stage,
// and a stage is refilled once the pass after it begins.
template <int kStages, int kStageBytes, bool kKernelDestinations>
__device__ void walkBulk(const char* __restrict__ src, char* __restrict__ dst, char* __restrict__ pool,
                         const int* __restrict__ perm, long long chunks, int warps) {
    constexpr unsigned kRing = kStages * kStageBytes;
    __shared__ __align__(128) unsigned char ring[8][kRing];
    __shared__ unsigned long long full[8][kStages];
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    long long first, count;
    warpShare<false>((long long)blockIdx.x * 8 + warp, chunks, warps, first, count);
    if (count == 0) return;
    unsigned const ringAt = (unsigned)__cvta_generic_to_shared(&ring[warp][0]);
    unsigned const fullAt = (unsigned)__cvta_generic_to_shared(&full[warp][0]);
    const char* const stream = src + first * 512;
    long long const bytes = count * 512;
    int const stages = (int)((bytes + kStageBytes - 1) / kStageBytes);
    auto const issue = [&](int k) {
        unsigned const slot = k & (kStages - 1);
        unsigned const n = k == stages - 1 ? (unsigned)(bytes - (long long)k * kStageBytes) : kStageBytes;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(fullAt + slot * 8), "r"(n)
                     : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                     ::"r"(ringAt + slot * kStageBytes), "l"(stream + (long long)k * kStageBytes), "r"(n),
                     "r"(fullAt + slot * 8) : "memory");
    };
    int issued = stages < kStages ? stages : kStages;
    if (lane == 0) {
        for (int s = 0; s < kStages; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(fullAt + s * 8) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (int k = 0; k < issued; ++k) issue(k);
    }
    __syncwarp();
    int consumed = 0;
    unsigned off = 0;
    for (long long i = 0; i < count; ++i) {
        unsigned const mine = off + 16 * lane;
        unsigned done = 0;
        do {
            asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                         "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done)
                         : "r"(fullAt + ((mine / kStageBytes) & (kStages - 1)) * 8), "r"((mine / kRing) & 1)
                         : "memory");
        } while (!done);
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(ringAt + (mine & (kRing - 1))) : "memory");
        unsigned const next = off + 512;
        consumed += next / kStageBytes != off / kStageBytes;
        off = next;
        if (issued < stages && issued < consumed + kStages) {
            __syncwarp();
            if (lane == 0) issue(issued);
            ++issued;
        }
        *reinterpret_cast<uint4*>(destination<kKernelDestinations>(dst, pool, perm, first + i, lane)) = v;
    }
}
#define BULK(S, B, K, NAME) extern "C" __global__ void __launch_bounds__(256, 3) NAME(const char* s, char* d, \
    char* pl, const int* pm, long long n, int w) { walkBulk<S, B, K>(s, d, pl, pm, n, w); }
BULK(4, 1024, false, bulk_copy_4x1024) BULK(8, 512, false, bulk_copy_8x512) BULK(2, 2048, false, bulk_copy_2x2048)
BULK(4, 1024, true, bulk_dest_4x1024) BULK(8, 512, true, bulk_dest_8x512) BULK(2, 2048, true, bulk_dest_2x2048)
"""
# (kernel, CTAs per SM it is launched at (None: torch's flat grid), what the row says)
WALKS = (
    ("copy_4", 3, "copy, cp.async depth 4"), ("copy_6", 3, "copy, cp.async depth 6"),
    ("copy_8", 3, "copy, cp.async depth 8"), ("dest_4", 3, "dest, cp.async depth 4"),
    ("dest_6", 3, "dest, cp.async depth 6"), ("dest_8", 3, "dest, cp.async depth 8"),
    ("dest_4_at4", 4, "dest, depth 4"), ("dest_4_at6", 6, "dest, depth 4"), ("dest_4_at8", 8, "dest, depth 4"),
    ("dest_4_tokens", 3, "dest, depth 4, token order"), ("dest_4_tokens_at6", 6, "dest, depth 4, token order"),
    ("regs_4", 3, "copy, registers x4"), ("regs_8", 3, "copy, registers x8"), ("regs_4_at6", 6, "copy, registers x4"),
    ("flat_copy", None, "copy, torch-like flat grid"),
)
BULK_WALKS = (  # sm_90: the per-warp ring of bulk copies (stages x bytes)
    ("bulk_copy_4x1024", 3, "copy, bulk 4 x 1024"), ("bulk_copy_8x512", 3, "copy, bulk 8 x 512"),
    ("bulk_copy_2x2048", 3, "copy, bulk 2 x 2048"), ("bulk_dest_4x1024", 3, "dest, bulk 4 x 1024"),
    ("bulk_dest_8x512", 3, "dest, bulk 8 x 512"), ("bulk_dest_2x2048", 3, "dest, bulk 2 x 2048"),
)

def _ok(result, what):
    from cuda.bindings import driver, nvrtc

    err, *rest = result
    if err not in (nvrtc.nvrtcResult.NVRTC_SUCCESS, driver.CUresult.CUDA_SUCCESS):
        raise RuntimeError(f"{what}: {err}")
    return rest[0] if len(rest) == 1 else None


def copy_walks(torch, triton) -> None:
    from cuda.bindings import driver, nvrtc

    tokens = 16384
    src = torch.randint(-2**31, 2**31 - 1, (tokens * 48 * 128 * 2 // 4,), device="cuda", dtype=torch.int32)
    dst = torch.empty_like(src)  # also makes torch's primary context current for the driver calls below
    pool = torch.empty(tokens // 16 * 65536 // 4, device="cuda", dtype=torch.int32)
    perm = torch.randperm(tokens // 16, device="cuda").to(torch.int32)
    props = torch.cuda.get_device_properties(0)
    prog = _ok(nvrtc.nvrtcCreateProgram(WALK_SOURCE.encode(), b"walk.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture=sm_{props.major}{props.minor}".encode(), b"-std=c++17"]
    compiled, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if compiled != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = b" " * _ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        _ok(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        raise RuntimeError(f"nvrtcCompileProgram: {log.decode(errors='replace')[:2000]}")
    cubin = b" " * _ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    _ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    module = _ok(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    moved = 2 * src.numel() * 4
    walks = WALKS + (BULK_WALKS if props.major >= 9 else ())
    for name, at, what in walks:
        fn = _ok(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")
        _ok(driver.cuFuncSetAttribute(
            fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100), "carveout")
        threads = 128 if at is None else 256
        per_sm = _ok(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, 0), "occupancy")
        # a wave of `at` CTAs per SM (3: the write kernel's 24 warps per SM), or torch's grid of short CTAs
        ctas = (tokens * 24 * 512) // (128 * 64) if at is None else min(per_sm, at) * props.multi_processor_count
        args = ((src.data_ptr(), dst.data_ptr(), pool.data_ptr(), perm.data_ptr(), tokens * 24, 8 * ctas),
                (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int))

        def launch(fn=fn, ctas=ctas, threads=threads, args=args):
            stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
            _ok(driver.cuLaunchKernel(fn, ctas, 1, 1, threads, 1, 1, 0, stream, args, 0), "cuLaunchKernel")

        dst.zero_()
        launch()
        torch.cuda.synchronize()
        if what.startswith("copy") and not torch.equal(dst, src):
            raise RuntimeError(f"{name}: the copy is wrong")
        us = 1000.0 * triton.testing.do_bench(launch, warmup=25, rep=200, return_mode="median")
        resident = "flat grid" if at is None else f"{min(per_sm, at)} CTAs/SM"
        print(f"walk {what:34s} {resident:10s} {us:7.1f} us  {moved / us / 1e6:5.2f} TB/s", flush=True)
    us = 1000.0 * triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    print(f"torch copy_ of the same 201 MB                  {us:7.1f} us  {moved / us / 1e6:5.2f} TB/s")
    driver.cuModuleUnload(module)


def ablations(torch, triton) -> None:
    from pagedkv.config import RopeConfig, RopeStyle

    neox = RopeConfig(theta=bw.THETA)
    cases = (("NeoX (the bench's)", "bf16", neox, False), ("no RoPE", "bf16", RopeConfig(style=RopeStyle.NONE), False),
             ("GPT-J", "bf16", RopeConfig(style=RopeStyle.GPTJ, theta=bw.THETA), False),
             ("NeoX, explicit positions", "bf16", neox, True), ("NeoX fp8 cache", "fp8", neox, False),
             ("no RoPE fp8 cache", "fp8", RopeConfig(style=RopeStyle.NONE), False))
    for page in (16, 64):
        step = bw.Step(bw.Shape(f"prefill 1x16384 P{page}", 1, 16384, 0, page), torch)
        for name, cache, rope, explicit in cases:
            launch, _, _, keep = bw.our_launcher(step, torch, cache, "HND", rope=rope, explicit_positions=explicit)
            us = bw.time_us(launch, torch, triton, graph=False)
            twice = bw.time_us(lambda launch=launch: (launch(), launch()), torch, triton, graph=True)
            print(f"P{page} {name:26s} {us:7.1f} us   x2 in one graph {twice:7.1f} (second {twice - us:6.1f})",
                  flush=True)
            del keep


def prefill_times(torch, triton) -> None:
    """Our kernel alone on bench_write's prefill cases (no peer, no value check): for comparing builds."""
    for page in (16, 64):
        for shape in (bw.Shape(f"prefill 1x16384 P{page}", 1, 16384, 0, page),
                      bw.Shape(f"prefill 8x2048 P{page}", 8, 2048, 0, page)):
            step = bw.Step(shape, torch)
            for cache, layout in (("bf16", "HND"), ("bf16", "NHD"), ("fp8", "HND")):
                launch, _, _, keep = bw.our_launcher(step, torch, cache, layout)
                us = bw.time_us(launch, torch, triton, graph=False)
                print(f"{shape.name:22s} {cache} {layout}  {us:7.1f} us", flush=True)
                del keep
            del step
    for shape in (bw.Shape("prefill 1x1024 P16", 1, 1024, 0, 16), bw.Shape("prefill 1x2048 P16", 1, 2048, 0, 16),
                  bw.Shape("prefill 1x4096 P16", 1, 4096, 0, 16)):
        step = bw.Step(shape, torch)
        launch, _, _, keep = bw.our_launcher(step, torch, "bf16", "HND")
        print(f"{shape.name:22s} bf16 HND  {bw.time_us(launch, torch, triton, graph=False):7.1f} us", flush=True)
        del keep, step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="copy,ablation", help="comma-separated: copy, ablation, prefill")
    ap.add_argument("--profile-once", action="store_true", help="two launches of the bench's case, for ncu")
    args = ap.parse_args()
    which = set(args.what.split(","))
    if which - {"copy", "ablation", "prefill"}:
        ap.error(f"--what: unknown {sorted(which - {'copy', 'ablation', 'prefill'})}; expected copy, ablation, prefill")
    import torch
    import triton

    if args.profile_once:
        step = bw.Step(bw.Shape("prefill 1x16384 P16", 1, 16384, 0, 16), torch)
        launch, _, _, keep = bw.our_launcher(step, torch, "bf16", "HND")
        for _ in range(2):
            launch()
            torch.cuda.synchronize()
        return 0
    if "copy" in which:
        copy_walks(torch, triton)
    if "ablation" in which:
        ablations(torch, triton)
    if "prefill" in which:
        prefill_times(torch, triton)
    return 0


if __name__ == "__main__":
    sys.exit(main())
