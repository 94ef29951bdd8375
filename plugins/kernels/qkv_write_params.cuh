// Kernel-side parameters of the fused QKV-preprocess + paged KV write, derived on the host by the launcher
// (qkv_write.cu) from the public QKVWriteParams (pagedkv/qkv_write.h). Plain C++ (no device intrinsics), so
// that the C API can evaluate the RoPE angle code on the host for tests.
//
// Work decomposition (see benchmarks/NOTES-write.md for the why):
//   head row   one head of one token in the packed QKV row: rows [0, H) are Q heads, [H, H+KVH) K heads,
//              [H+KVH, H+2KVH) V heads (NHR = H + 2*KVH rows per token)
//   vector     8 consecutive elements of a head row (16 B of fp16/bf16); VPH = D/8 vectors per row
//   lane       one thread owns one vector index j of a row for the whole kernel (lane % VPH), so its RoPE
//              frequencies never change: they are set up once, and cos/sin are computed once per token
//   pass       a warp covers RPP = floor(32/VPH) consecutive rows of one token (one contiguous read of RPP * D
//              elements: 512 B of fp16/bf16 when VPH divides 32); a token is P = ceil(NHR / RPP) passes. When
//              VPH does not divide 32 (D = 80: 3 rows on 30 lanes, D = 96: 2 rows on 24) the lanes past the
//              last row hold vectors past the end of it: they load and store nothing
//   warp range each warp owns a balanced contiguous range of the T * P (token, pass) pairs and streams through
//              it with a few loads in flight; sequence lookup, page lookup and cos/sin happen once per token
//              it enters. Decode: one pass per warp, a token spread over many warps; medium steps: every
//              resident warp on a few passes, one wave; long prefills: one warp per token, a grid of many waves
//              (qkvWriteWarps says when and why), run by the kernel's one-token instance (kTokenWarp: its loads
//              and q offsets walk the token by adds, with none of a general range's token-wrap bookkeeping).
#pragma once

#include <cmath>
#include <cstdint>

#include "pagedkv/qkv_write.h"

namespace pagedkv {

constexpr int32_t kQKVWriteThreads = 256;  // threads per CTA (8 independent warps)
constexpr int32_t kQKVWriteWarps = kQKVWriteThreads / 32;
constexpr int32_t kQKVWriteMinCTAsPerSM = 3;  // __launch_bounds__: caps registers at 80 per thread
constexpr int32_t kQKVWritePrefetchRows = 4;  // 16-byte loads a thread keeps in flight (shared-memory ring)

// Where the kernel finds the partner element of a rotated element.
enum class RopePartner : int32_t {
    kNone = 0,      // no rotation (RopeStyle::kNone)
    kInVector = 1,  // GPT-J: partner (2i, 2i+1) sits in the same 8-element vector
    kShuffle = 2,   // NeoX with (R/2) % 8 == 0: the partner vector is R/16 lanes away in the same row
    kGlobal = 3,    // NeoX with (R/2) % 8 != 0: partners straddle two vectors; scalar loads from the row
};

struct QKVWritePlan {
    int32_t vecsPerRow;      // VPH = D / 8 (4 .. 32)
    int32_t laneRowMagic;    // lane / VPH = laneRowOf(lane, laneRowMagic) for every lane (a multiply, no divide)
    int32_t rowsPerPass;     // RPP = floor(32 / VPH) rows per warp pass
    int32_t numHeadRows;     // NHR = H + 2*KVH
    int32_t passesPerToken;  // P = ceil(NHR / rowsPerPass)
    int64_t totalPasses;     // T * P (< 2^30, validated)
    int32_t numWarps;        // warps sharing the passes: qkvWriteWarps(...), set at launch
};

struct QKVWriteKernelParams {
    QKVWriteParams p;  // the caller's parameters, validated
    QKVWritePlan plan;
    RopePartner ropePartner;
    int32_t ropeHalf;   // R/2 (0 without rotation)
    float seqsPerToken;  // B / T: the kernel's first guess of a token's sequence is t * B / T
    float invKScale;    // 1/k_scale, 1/v_scale, 1/q_scale (cache_convert.cuh multiplies by 1/scale)
    float invVScale;
    float invQScale;
    int32_t ropeLongAboveKVLen;  // LongRoPE: > 0, sequences past this kv length rotate with ropeTurnsLong; else 0
    // RoPE rotation per position step, as a 0.64 fixed-point fraction of a turn: frac(invFreq / 2pi) * 2^64.
    // The kernel reduces `position * invFreq` modulo one turn exactly with a 64-bit integer product.
    uint64_t ropeTurns[kMaxRotaryPairs];
    uint64_t ropeTurnsLong[kMaxRotaryPairs];  // the same of longInvFreq (LongRoPE only; zeros otherwise)
};

// Host: one inverse frequency (radians per position) -> turns per position, 0.64 fixed point. The float
// invFreq is taken as exact; the division by 2 pi runs in long double (64-bit significand on x86-64), so the
// rate is off by < 2^-63 turn and the angle by < 1e-8 rad even at position 2^31 (a float product
// pos * invFreq is off by up to ulp(pos * invFreq) / 2: 4e-3 rad at 128K).
inline uint64_t ropeTurnsPerPosition(float invFreq) {
    constexpr long double kTwoPi = 6.283185307179586476925286766559005768L;
    long double turns = static_cast<long double>(invFreq) / kTwoPi;
    turns -= std::floor(turns);  // exact; in [0, 1)
    long double const scaled = std::ldexp(turns, 64);
    // A fraction within half an ulp of 1 rounds to 2^64, i.e. a whole turn: 0.
    return scaled >= std::ldexp(1.0L, 64) ? 0 : static_cast<uint64_t>(scaled);
}

// RoPE angle of `position` for one frequency, reduced to [-pi, pi). The product position * turns is taken
// modulo 2^64 (i.e. modulo one turn) by unsigned wrap-around, exactly, negative positions included (two's
// complement); its top 32 bits, read as a signed fraction of a turn, give the angle. Error < 4e-7 rad for every
// int32 position (2^-32 turn dropped, two float roundings of an angle <= pi), independent of the position.
PKV_HD float ropeAngle(int32_t position, uint64_t turnsPerPosition) {
    uint64_t turns = static_cast<uint64_t>(static_cast<int64_t>(position)) * turnsPerPosition;
    int32_t top = static_cast<int32_t>(static_cast<uint32_t>(turns >> 32));
    constexpr float kRadiansPerUnit = 1.46291807926715968e-9f;  // 2 pi / 2^32
    return static_cast<float>(top) * kRadiansPerUnit;
}

// Which row of a warp pass lane `lane` (< 32) falls in, lane / VPH, as (lane * magic) >> 16 with
// magic = ceil(2^16 / VPH): exact for every lane < 32 and VPH <= 32 (the rounding error lane * (magic * VPH -
// 2^16) / 2^16 stays below 1/VPH; qkv_write.cu checks every supported head dim at compile time).
PKV_HD constexpr int32_t laneRowMagic(int32_t vecsPerRow) { return (65536 + vecsPerRow - 1) / vecsPerRow; }
PKV_HD constexpr int32_t laneRowOf(int32_t lane, int32_t magic) { return (lane * magic) >> 16; }

// Rotation coefficients of element `dim` of a head (PKV_HD so that the host can check them): whether it
// rotates, its frequency index, and whether it is the first of its pair (out = x*cos - partner*sin) or the
// second (out = x*cos + partner*sin). Dims >= R pass through.
struct RopeElem {
    bool rotates;
    bool first;
    int32_t freq;
    int32_t partnerDim;
};

PKV_HD RopeElem ropeElem(RopeStyle style, int32_t rotaryDim, int32_t dim) {
    RopeElem e{false, false, 0, dim};
    if (style == RopeStyle::kNone || dim >= rotaryDim) return e;
    int32_t half = rotaryDim / 2;
    e.rotates = true;
    if (style == RopeStyle::kGptj) {  // pairs (2i, 2i + 1)
        e.first = (dim & 1) == 0;
        e.freq = dim >> 1;
        e.partnerDim = dim ^ 1;
    } else {  // NeoX: pairs (i, i + R/2)
        e.first = dim < half;
        e.freq = e.first ? dim : dim - half;
        e.partnerDim = e.first ? dim + half : dim - half;
    }
    return e;
}

// Long prefills run one warp per token once their grid spans this many waves of resident warps: fewer waves leave
// a partial last wave that costs more than one wave of longer ranges (H200, 1 x 4096 tokens = 1.3 waves: 43.0 us
// as one-token warps, 35.7 us as one wave; 1 x 16384 = 5.2 waves: 110.6 against 116.5).
constexpr int64_t kQKVWriteTokenWarpWaves = 4;

// Host: how many warps share the T * P (token, pass) pairs (T >= 1), given the warps of one resident wave:
//  - T * P <= resident: one warp per pair (decode: a token spread over P warps, all its head rows in parallel);
//  - else, when whole warps per token, wpt = resident / T >= 4, still fill >= 3/4 of the wave: T * wpt warps.
//    The kernel's balanced ranges [w * T*P / N, (w+1) * T*P / N) with N = T * wpt are then, for
//    w = t * wpt + j, [t*P + j*P/wpt, t*P + (j+1)*P/wpt) (floors): no range straddles two tokens, so no warp
//    pays two tokens' chains of dependent loads (sequence, block table), which would set the kernel's latency
//    in a decode batch of a few hundred tokens;
//  - else, T >= kQKVWriteTokenWarpWaves x resident (a long prefill): one warp per token (ranges [t*P, (t+1)*P)),
//    a grid of T / 8 CTAs over several waves. The same byte stream (benchmarks/NOTES-write.md, round 6) copies
//    in 103.7 us on the H200 as a grid of short CTAs, in 107-109 us as one wave of long warp ranges whatever their
//    ring depth, occupancy or order;
//  - else: every resident warp, one wave, each with a range of a few tokens' passes.
inline int32_t qkvWriteWarps(int64_t totalPasses, int32_t numTokens, int64_t residentWarps) {
    if (totalPasses <= residentWarps) return static_cast<int32_t>(totalPasses);
    int64_t const warpsPerToken = residentWarps / numTokens;
    if (warpsPerToken >= 4) return static_cast<int32_t>(numTokens * warpsPerToken);
    if (numTokens >= kQKVWriteTokenWarpWaves * residentWarps) return numTokens;
    return static_cast<int32_t>(residentWarps);
}

// Host: checks everything the host can see (dims, dtypes, layout vs counts, RoPE table, scales, pointers);
// on failure returns cudaErrorInvalidValue with the field and value in lastErrorMessage(). No CUDA calls.
cudaError_t validateQKVWrite(QKVWriteParams const& params);

// Host: the work plan and kernel parameters of validated params (plan.numWarps is set at launch, from the
// instance's occupancy).
QKVWritePlan makeQKVWritePlan(QKVWriteParams const& params);
QKVWriteKernelParams makeQKVWriteKernelParams(QKVWriteParams const& params);

// Launches the kernel instance for (IO, C) with an occupancy-sized grid (qkv_write_kernel.cuh). Explicitly
// instantiated per I/O dtype in qkv_write_fp16.cu / qkv_write_bf16.cu; launchQKVWrite (qkv_write.cu) is the
// only caller and the single dispatch point.
template <IODType IO, CacheDType C>
cudaError_t runQKVWriteKernel(QKVWriteKernelParams const& kp, int32_t smCount, cudaStream_t stream);

}  // namespace pagedkv
