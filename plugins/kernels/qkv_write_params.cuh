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
//   pair       (token t, pass) numbered g = t * P + pass; a launch's T * P pairs are cut into balanced contiguous
//              ranges [floor(w * T*P / N), floor((w + 1) * T*P / N)) of N warps (no tail wave)
//   group      W consecutive warps of a CTA (1, 2, 4 or 8) walk the union of their ranges together, member m taking
//              pairs m, m + W, m + 2W, ... of it. W = 1: each warp its own range, pair after pair (decode: one or
//              two passes per warp, a token spread over many warps, all its head rows in parallel). W = 8: the
//              CTA's 8 warps on 8 neighbouring passes at any instant (4 KB of contiguous qkv, neighbouring q and
//              K/V rows; ~C token streams over the GPU instead of ~8 C: prefill, NOTES-write.md round 4)
//   records    a group sets up the tokens its range touches (sequence, page, RoPE position) once, 8 W at a time
//              in shared memory; a warp computes the cos/sin of each token it enters
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
    int32_t rowElems;        // NHR * D: a token's qkv row
    int32_t qRowElems;       // H * D: a token's q row
    int32_t passElems;       // RPP * D: a pass's share of a qkv row
    int32_t kvRowBegin;      // H: the first K head row
    int32_t vRowBegin;       // H + KVH: the first V head row
    int32_t numWarps;        // N, warps sharing the passes: qkvWriteGrid(...), set at launch
    int32_t groupWarps;      // W, warps walking a range together (1, 2, 4 or 8), set at launch
    int32_t groupShift;      // log2(W)
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

// Host: how many warps share the T * P (token, pass) pairs (T >= 1) and in groups of how many warps they walk
// them, given the warps of one resident wave (a multiple of kQKVWriteWarps) and the caller's group size (0: auto):
//  - T * P <= resident: one warp per pair (decode: a token spread over P warps, all its head rows in parallel);
//  - else, when whole warps per token, wpt = resident / T >= 4, still fill >= 3/4 of the wave: T * wpt warps.
//    The kernel's balanced ranges [w * T*P / N, (w+1) * T*P / N) with N = T * wpt are then, for
//    w = t * wpt + j, [t*P + j*P/wpt, t*P + (j+1)*P/wpt) (floors): with groups of one warp no range straddles two
//    tokens, so no warp sets up two tokens, which would set the kernel's latency in a decode batch of a few
//    hundred tokens;
//  - else (prefill): every resident warp, each with a range of many passes.
// Auto: groups of one warp for the first two (latency-bound: a warp's one or two passes), of
// kQKVWritePrefillGroupWarps for prefill (bandwidth-bound: neighbouring warps on neighbouring bytes).
constexpr int32_t kQKVWritePrefillGroupWarps = 8;

struct QKVWriteGrid {
    int32_t numWarps;    // N
    int32_t groupShift;  // log2 of the warps per group
    // the plan of a launch: plan (from makeQKVWritePlan) with this grid's fields set
    QKVWritePlan apply(QKVWritePlan plan) const {
        plan.numWarps = numWarps;
        plan.groupShift = groupShift;
        plan.groupWarps = 1 << groupShift;
        return plan;
    }
};

// Host: groupWarps is 0 (auto) or one of 1, 2, 4, 8 (validated by the launcher).
inline QKVWriteGrid qkvWriteGrid(int64_t totalPasses, int32_t numTokens, int64_t residentWarps,
                                 int32_t groupWarps) {
    QKVWriteGrid grid{static_cast<int32_t>(residentWarps), 0};
    bool prefill = false;
    if (totalPasses <= residentWarps) {
        grid.numWarps = static_cast<int32_t>(totalPasses);
    } else if (residentWarps / numTokens >= 4) {
        grid.numWarps = static_cast<int32_t>(numTokens * (residentWarps / numTokens));
    } else {
        prefill = true;
    }
    int32_t const warps = groupWarps != 0 ? groupWarps : prefill ? kQKVWritePrefillGroupWarps : 1;
    while ((1 << grid.groupShift) < warps) ++grid.groupShift;
    return grid;
}

// Where warp w's balanced range of pairs begins: floor(w * T*P / N) (w <= N). A 32-bit division when the product
// fits (every launch up to ~4 G: decode and the benchmark's prefills), since the kernel's prologue waits for it.
PKV_HD int32_t qkvWriteRangeStart(QKVWritePlan const& plan, int32_t warp) {
    uint64_t const n = static_cast<uint64_t>(warp) * static_cast<uint64_t>(plan.totalPasses);
    uint32_t const warps = static_cast<uint32_t>(plan.numWarps);
    if (n <= 0xffffffffull) return static_cast<int32_t>(static_cast<uint32_t>(n) / warps);
    return static_cast<int32_t>(n / static_cast<uint64_t>(plan.numWarps));
}

// A warp's place in its walk over (token, pass) pairs: the pair it is at and how many are left (this one
// included). advance() moves to the pair `step` (the group's warps) further on; a step of up to 8 crosses at most
// one token when P >= 8, smaller P loop.
struct QKVWriteCursor {
    int32_t token;
    int32_t pass;
    int32_t left;

    PKV_HD void advance(int32_t step, int32_t passesPerToken) {
        pass += step;
        while (pass >= passesPerToken) {
            pass -= passesPerToken;
            ++token;
        }
        --left;
    }
};

// A group of 2^plan.groupShift consecutive warps of a CTA: its balanced range of pairs (the union of its warps'
// ranges [start(w), start(w + 1))), which its warps walk together, member m taking pairs m, m + W, m + 2W, ... of
// it; and the tokens that range touches (its window), which the group sets up kQKVWriteRecordsPerWarp * W at a
// time (qkvWriteChunkRounds, qkv_write_kernel.cuh). Groups of one warp are the warp ranges of rounds 1-3; a group
// of 8 is the CTA.
struct QKVWriteGroup {
    int32_t begin;        // pairs [begin, end)
    int32_t end;
    int32_t firstToken;   // the window: tokens [firstToken, firstToken + tokenCount)
    int32_t tokenCount;   // 0: an empty range (warps past N)
};
constexpr int32_t kQKVWriteRecordsPerWarp = 8;  // token records a group keeps per warp of it (64 per CTA)

// The range of warps [first, first + count) (clamped to N) and its window.
PKV_HD QKVWriteGroup qkvWriteWarpsRange(QKVWritePlan const& plan, int32_t first, int32_t count) {
    int32_t const last = first + count < plan.numWarps ? first + count : plan.numWarps;
    QKVWriteGroup g{0, 0, 0, 0};
    if (first >= plan.numWarps) return g;
    g.begin = qkvWriteRangeStart(plan, first);
    g.end = qkvWriteRangeStart(plan, last);
    if (g.end > g.begin) {
        g.firstToken = g.begin / plan.passesPerToken;
        g.tokenCount = (g.end - 1) / plan.passesPerToken - g.firstToken + 1;
    }
    return g;
}

PKV_HD QKVWriteGroup qkvWriteGroup(QKVWritePlan const& plan, int32_t cta, int32_t warpInCta) {
    int32_t const first = cta * kQKVWriteWarps + ((warpInCta >> plan.groupShift) << plan.groupShift);
    return qkvWriteWarpsRange(plan, first, plan.groupWarps);
}

// Rounds of token records a CTA goes through: enough chunks of kQKVWriteRecordsPerWarp * W tokens for any of its
// groups' windows, which the CTA's window bounds (exact for W = 8; for smaller groups the last rounds may be empty),
// and at least 1. All its groups set up their chunk r in round r, between CTA barriers, so the barriers stay
// CTA-wide (__syncthreads) whatever W is.
PKV_HD int32_t qkvWriteChunkRounds(QKVWritePlan const& plan, int32_t cta) {
    int32_t const chunkTokens = kQKVWriteRecordsPerWarp * plan.groupWarps;
    int32_t const tokens = qkvWriteWarpsRange(plan, cta * kQKVWriteWarps, kQKVWriteWarps).tokenCount;
    return tokens > chunkTokens ? (tokens + chunkTokens - 1) / chunkTokens : 1;
}

// The walk of warp `warpInCta` of CTA `cta` in its group (the kernel and the host replay, qkv_write.cu, both start
// here): its first pair and how many pairs it visits.
PKV_HD QKVWriteCursor qkvWriteWalk(QKVWritePlan const& plan, QKVWriteGroup const& g, int32_t warpInCta) {
    int32_t const first = g.begin + (warpInCta & (plan.groupWarps - 1));
    int32_t const count = first < g.end ? (g.end - first + plan.groupWarps - 1) >> plan.groupShift : 0;
    int32_t const token = count > 0 ? first / plan.passesPerToken : 0;
    return QKVWriteCursor{token, count > 0 ? first - token * plan.passesPerToken : 0, count};
}

// Host: checks everything the host can see (dims, dtypes, layout vs counts, RoPE table, scales, pointers);
// on failure returns cudaErrorInvalidValue with the field and value in lastErrorMessage(). No CUDA calls.
cudaError_t validateQKVWrite(QKVWriteParams const& params);

// Host: the work plan and kernel parameters of validated params (plan.numWarps is set at launch, from the
// instance's occupancy).
QKVWritePlan makeQKVWritePlan(QKVWriteParams const& params);
QKVWriteKernelParams makeQKVWriteKernelParams(QKVWriteParams const& params);

// Host: the kernel's walk replayed on the CPU (qkv_write.cu) for a step of params.meta.numTokens tokens with
// these head counts and head dim, group size `groupWarps` (0: auto) and `residentWarps` resident warps (a multiple
// of 8): visits[g] counts the visits of pair g = t * P + pass (int32[T * P]; every pair exactly once is the
// contract), and the replay checks that every pair falls in a chunk of its group's token records. Only the shape
// fields of `params` are read. No CUDA calls.
struct QKVWriteReplay {
    int32_t numWarps;      // N of the grid
    int32_t groupWarps;    // W of the walk
    int64_t tokenEntries;  // token entries (record reads + cos/sin) over all warps
    int64_t chunksBuilt;   // record chunks set up over all groups
    int64_t pairsVisited;
};
cudaError_t replayQKVWriteSchedule(QKVWriteParams const& params, int32_t groupWarps, int64_t residentWarps,
                                   int32_t* visits, QKVWriteReplay& out);

// Launches the kernel instance for (IO, C) with an occupancy-sized grid walked in groups of `groupWarps` warps
// (0: qkvWriteGrid chooses; qkv_write_kernel.cuh). Explicitly instantiated per I/O dtype in qkv_write_fp16.cu /
// qkv_write_bf16.cu; launchQKVWrite (qkv_write.cu) is the only caller and the single dispatch point.
template <IODType IO, CacheDType C>
cudaError_t runQKVWriteKernel(QKVWriteKernelParams const& kp, int32_t smCount, int32_t groupWarps,
                              cudaStream_t stream);

}  // namespace pagedkv
