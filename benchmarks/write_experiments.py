"""Experiments behind NOTES-write.md round 5 (not a product benchmark; bench_write.py is): what bounds the
16K-token bf16 prefill of the fused QKV write.

  --what copy      the kernel's byte stream without its arithmetic: 201 MB of packed qkv read in 512-byte warp
                   passes (24 per token, balanced warp ranges, 3 CTAs x 8 warps per SM, cp.async ring as the
                   kernel's), written straight back ("copy") or where the kernel writes them (q rows contiguous, K
                   and V head rows into shuffled HND pages of 16 tokens), ring depths 4 / 6 / 8; torch's copy_
                   next to them. NVRTC (cuda-python) compiles the walk for the GPU at hand.
  --what ablation  our kernel (bf16 HND, P16 and P64) with RoPE off, GPT-J, explicit positions and an fp8 cache,
                   each alone and as the second of two launches in one graph (warm constant / instruction caches).
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
template <int kDepth, bool kKernelDestinations>
__device__ void walk(const char* __restrict__ src, char* __restrict__ dst, char* __restrict__ pool,
                     const int* __restrict__ perm, long long chunks, int warps) {
    constexpr int kSlots = kDepth + 1;
    __shared__ __align__(16) unsigned char ring[kSlots][256][16];
    int const lane = threadIdx.x & 31;
    long long const w = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    long long first = 0, count = 0;
    if (w < warps) { first = w * chunks / warps; count = (w + 1) * chunks / warps - first; }
    unsigned const column = (unsigned)__cvta_generic_to_shared(&ring[0][threadIdx.x][0]);
    long long ahead = first;
    auto const issue = [&](int slot, bool valid) {
        const char* const from = valid ? src + ahead * 512 + 16 * lane : src;
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
        long long const c = first + i;
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
        *reinterpret_cast<uint4*>(to) = v;
        slot = slot == kDepth ? 0 : slot + 1;
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
#define WALK(D, K, NAME) extern "C" __global__ void __launch_bounds__(256, 3) NAME(const char* s, char* d, \
    char* pl, const int* pm, long long n, int w) { walk<D, K>(s, d, pl, pm, n, w); }
WALK(4, false, copy_4) WALK(6, false, copy_6) WALK(8, false, copy_8)
WALK(4, true, dest_4) WALK(6, true, dest_6) WALK(8, true, dest_8)
"""


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
    for name in ("copy_4", "copy_6", "copy_8", "dest_4", "dest_6", "dest_8"):
        fn = _ok(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")
        _ok(driver.cuFuncSetAttribute(
            fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 50), "carveout")
        per_sm = _ok(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, 256, 0), "occupancy")
        ctas = min(per_sm, 3) * props.multi_processor_count  # the write kernel's wave: 24 warps per SM
        args = ((src.data_ptr(), dst.data_ptr(), pool.data_ptr(), perm.data_ptr(), tokens * 24, 8 * ctas),
                (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int))

        def launch(fn=fn, ctas=ctas, args=args):
            stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
            _ok(driver.cuLaunchKernel(fn, ctas, 1, 1, 256, 1, 1, 0, stream, args, 0), "cuLaunchKernel")

        launch()
        torch.cuda.synchronize()
        if name.startswith("copy") and not torch.equal(dst, src):
            raise RuntimeError(f"{name}: the copy is wrong")
        us = 1000.0 * triton.testing.do_bench(launch, warmup=25, rep=200, return_mode="median")
        what = "copy" if name.startswith("copy") else "kernel destinations"
        print(f"walk {what:20s} depth {name[-1]}  {min(per_sm, 3)} CTAs/SM  {us:7.1f} us  "
              f"{moved / us / 1e6:5.2f} TB/s", flush=True)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="copy,ablation", help="comma-separated: copy, ablation")
    ap.add_argument("--profile-once", action="store_true", help="two launches of the bench's case, for ncu")
    args = ap.parse_args()
    which = set(args.what.split(","))
    if which - {"copy", "ablation"}:
        ap.error(f"--what: unknown {sorted(which - {'copy', 'ablation'})}; expected copy and/or ablation")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
