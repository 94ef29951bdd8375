// Fused QKV preprocess + paged KV write: the kernel and its grid sizing (instantiated by qkv_write_fp16.cu and
// qkv_write_bf16.cu; launchQKVWrite in qkv_write.cu validates and dispatches). Legend and work decomposition:
// qkv_write_params.cuh; design notes and byte counts: benchmarks/NOTES-write.md.
//
// One launch per layer and step. Every byte of the packed QKV rows is read once (16-byte asynchronous copies
// into a shared-memory ring, kPrefetch passes ahead), every byte of q and of the new K/V rows is written once
// (16-byte stores, 8-byte for 1-byte dtypes). All pool addresses come from the contract helpers in kv_layout.h
// (locateToken, elemOffset).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "cache_convert.cuh"
#include "pagedkv/kv_layout.h"
#include "pagedkv/step_metadata.h"
#include "qkv_write_params.cuh"
#include "vec.cuh"

namespace pagedkv {
namespace qkvwrite {

template <IODType D>
struct IOStorage;
template <>
struct IOStorage<IODType::kFP16> {
    using type = __half;
};
template <>
struct IOStorage<IODType::kBF16> {
    using type = __nv_bfloat16;
};

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int32_t kPrefetch = kQKVWritePrefetchRows;
// Ring of asynchronous copies: kPrefetch in flight plus the slot being processed, so that a copy is only ever
// issued into the slot read one pass earlier (that read has landed: its value was consumed).
constexpr int32_t kRingSlots = kPrefetch + 1;

// The sequence owning a token and what the write needs of it.
struct alignas(16) SeqSpan {
    int32_t seq;      // b
    int32_t begin;    // cuQLens[b]: first token of the sequence in the step
    int32_t end;      // cuQLens[b + 1]
    int32_t pastLen;  // pastLens[b]: tokens cached before this step
};

// The sequence of token t: the largest b with cuQLens[b] <= t (so empty sequences are skipped). All 32 lanes
// call it with the same t. First a guess that is exact for decode batches (one token per sequence) and for
// equal-length chunks, fetched together with its pastLen in one round trip; on a miss, a 32-ary search with
// one coalesced load and a ballot per round (B <= 32: one round, B <= 1024: two). Whatever cuQLens holds, the
// result stays in [0, B): bad metadata can mislocate a token but never index outside the metadata arrays.
//
// guessSequence only issues the guess's three loads (nothing waits for them until a value is used), so that the
// kernel can start them early for its first token; findSequence checks the guess and searches on a miss.
__device__ __forceinline__ SeqSpan guessSequence(StepMetadata const& meta, float seqsPerToken, int32_t t) {
    // The guess needs no exact division: a float estimate of t * B / T (seqsPerToken = B / T on the host).
    int32_t guess = __float2int_rd((static_cast<float>(t) + 0.5f) * seqsPerToken);
    guess = min(max(guess, 0), meta.numSeqs - 1);
    return SeqSpan{guess, __ldg(meta.cuQLens + guess), __ldg(meta.cuQLens + guess + 1), __ldg(meta.pastLens + guess)};
}

__device__ __forceinline__ SeqSpan findSequence(StepMetadata const& meta, float seqsPerToken, int32_t t,
                                               int32_t lane) {
    int32_t const numSeqs = meta.numSeqs;
    int32_t const* cuQ = meta.cuQLens;
    SeqSpan const guessed = guessSequence(meta, seqsPerToken, t);
    int32_t const guess = guessed.seq;
    int32_t const guessBegin = guessed.begin;
    if (guessBegin <= t && t < guessed.end) return guessed;

    // Search [lo, hi): the answer is < hi, and cuQ[lo] <= t holds (cuQ[0] = 0 <= t, or cuQ[guess+1] <= t).
    int32_t lo = 0;
    int32_t hi = numSeqs;
    if (t < guessBegin) {
        hi = max(guess, 1);
    } else {
        lo = min(guess + 1, numSeqs - 1);  // t >= cuQ[B] (a token no sequence owns) ends at B-1
    }
    while (hi - lo > 1) {
        int32_t const stride = (hi - lo + 31) >> 5;
        int32_t const idx = lo + lane * stride;
        bool const atOrBefore = idx < hi && __ldg(cuQ + idx) <= t;
        int32_t const count = __popc(__ballot_sync(kFullMask, atOrBefore));
        int32_t const newLo = lo + max(count - 1, 0) * stride;
        hi = min(hi, newLo + stride);
        lo = newLo;
    }
    return SeqSpan{lo, __ldg(cuQ + lo), __ldg(cuQ + lo + 1), __ldg(meta.pastLens + lo)};
}

// Raises the step's status record for token t of sequence `span`, whose page is unusable (its K/V are skipped).
// The first reporter (atomicOr saw no flag yet) also records where; later ones only add their flag bit. Rare
// path: it looks the location up again, so that none of it occupies registers in the hot loop.
__device__ __forceinline__ void reportBadPage(int32_t* status, SeqSpan const& span, int32_t t,
                                              KVLayout const& layout, StepMetadata const& meta,
                                              int64_t const* poolDesc) {
    int32_t const maxBlocks = meta.maxBlocks;
    int32_t const seq = span.seq;
    BlockTableRow const blockRow{meta.blockTable + static_cast<int64_t>(seq) * maxBlocks, maxBlocks,
                                 __ldg(poolDesc + kPoolDescNumBlocks)};
    KVLocation const loc = locateToken(layout, blockRow, span.pastLen + (t - span.begin));
    int32_t const flag = (loc.pageInSeq < 0 || loc.pageInSeq >= maxBlocks) ? kStatusPastBlockTable
                         : loc.rawEntry == kInvalidBlock                    ? kStatusInvalidBlock
                                                                            : kStatusBlockOutOfRange;
    if (atomicOr(status + kStatusFlags, flag) == 0) {
        status[kStatusSeq] = seq;
        status[kStatusPageInSeq] = loc.pageInSeq;
        status[kStatusEntry] = loc.rawEntry;
    }
}

// Brings the lines of the kernel's parameter block that the first pass reads into the constant cache, all in
// flight at once. A parameter operand that misses stalls its instruction, and the instructions behind it wait
// in order: touched one by one as the code reaches them (the first loads' addresses, the metadata, the pool
// descriptor, RoPE, q output, status), the ~8 distinct lines are a chain of dependent misses at kernel start,
// where a decode step has nothing else to overlap them with. The turns table (ropeTurns) too: the kernel stages it
// after its first token records, i.e. after two round trips, and finds its lines cached then. Skipped: the RoPE
// frequency tables of the caller's parameters (invFreq, longInvFreq: never read by the kernel) and the LongRoPE
// turns table (staged by the few launches that use it).
// Returns a value the caller must store (a real use, so that the compiler keeps the loads).
__device__ __forceinline__ uint32_t warmParameterLines(QKVWriteKernelParams const& kp) {
    constexpr size_t kLine = 64;
    constexpr size_t kFreqTable =
        offsetof(QKVWriteKernelParams, p) + offsetof(QKVWriteParams, rope) + offsetof(RopeParams, invFreq);
    constexpr size_t kAfterFreqTable = offsetof(QKVWriteKernelParams, p) + offsetof(QKVWriteParams, rope) +
                                       offsetof(RopeParams, longInvFreq) + sizeof(RopeParams::longInvFreq);
    constexpr size_t kTurnsTable = offsetof(QKVWriteKernelParams, ropeTurns);
    static_assert(offsetof(QKVWriteKernelParams, p) == 0 && kAfterFreqTable <= kTurnsTable &&
                      offsetof(RopeParams, longInvFreq) == offsetof(RopeParams, invFreq) + sizeof(RopeParams::invFreq) &&
                      offsetof(QKVWriteKernelParams, ropeTurnsLong) ==
                          kTurnsTable + sizeof(QKVWriteKernelParams::ropeTurns) &&
                      sizeof(QKVWriteKernelParams) == offsetof(QKVWriteKernelParams, ropeTurnsLong) +
                                                          sizeof(QKVWriteKernelParams::ropeTurnsLong),
                  "the parameter block's layout assumed below: both frequency tables, then both turns tables last");
    unsigned char const* const bytes = reinterpret_cast<unsigned char const*>(&kp);
    uint32_t touched = 0;
#pragma unroll
    for (size_t at = 0; at < kFreqTable + 16; at += kLine) touched ^= bytes[at];  // + the line of rope.style
#pragma unroll
    for (size_t at = kAfterFreqTable; at < kTurnsTable + sizeof(QKVWriteKernelParams::ropeTurns); at += kLine)
        touched ^= bytes[at];
    return touched;
}

// ---- per-lane constants -------------------------------------------------------------------------------------

// Which row of a warp pass and which 8-element vector of it a lane owns, for the whole kernel. The lanes past the
// pass's last row (VPH not dividing 32) count as vectors past the end of that row: vec >= VPH, dims >= D, so they
// rotate nothing and stage their own words; their head row is out of range (rowSlot), so they load and store
// nothing.
struct LaneRow {
    int32_t slot;     // row of the pass (the last one for lanes past it)
    int32_t vec;      // vector of the row (>= VPH past the last row)
    int32_t dim0;     // first head dim of the vector
    int32_t rowSlot;  // head row of pass `pass` = pass * RPP + rowSlot (NHR past the last row: never in range)
};

__device__ __forceinline__ LaneRow laneRow(QKVWritePlan const& plan, int32_t lane) {
    LaneRow r;
    r.slot = min(laneRowOf(lane, plan.laneRowMagic), plan.rowsPerPass - 1);
    r.vec = lane - r.slot * plan.vecsPerRow;
    r.dim0 = r.vec * kVecElems;
    r.rowSlot = r.vec < plan.vecsPerRow ? r.slot : plan.numHeadRows;
    return r;
}

// The lane's RoPE coefficients: they depend on its vector only, so they are set up once; per token only the angle
// changes.
struct LaneRope {
    uint32_t rotateMask;  // bit k: dim0 + k rotates (kShuffle: all 8 dims or none, R/2 being a multiple of 8)
    uint32_t firstMask;   // bit k: dim0 + k is the first of its pair (x*cos - partner*sin)
    int32_t partnerLane;  // kShuffle: the lane holding dims dim0 +- R/2 of the same row
};

__device__ __forceinline__ LaneRope laneRope(QKVWriteKernelParams const& kp, LaneRow const& r, int32_t lane) {
    RopeParams const& rope = kp.p.rope;
    LaneRope lr{0u, 0u, lane};
#pragma unroll
    for (int k = 0; k < kVecElems; ++k) {
        RopeElem const e = ropeElem(rope.style, rope.rotaryDim, r.dim0 + k);
        lr.rotateMask |= e.rotates ? (1u << k) : 0u;
        lr.firstMask |= (e.rotates && e.first) ? (1u << k) : 0u;
    }
    if (kp.ropePartner == RopePartner::kShuffle && lr.rotateMask != 0) {
        int32_t const laneDelta = kp.ropeHalf / kVecElems;
        lr.partnerLane = r.dim0 < kp.ropeHalf ? lane + laneDelta : lane - laneDelta;
    }
    return lr;
}

// ---- per-token set-up, once per group -----------------------------------------------------------------------

// What every warp needs of one token of its group's window, set up by one warp of the group for up to
// kMaxChunkTokens tokens at once (buildTokenRecords) and read by the group's warps when their walks enter it.
template <typename kv_t>
struct alignas(16) TokenRecord {
    int32_t ropePos;  // RoPE position (position_ids[t], or the cache position)
    uint32_t bits;    // kRecord* flags | tailRows << kRecordTailShift
    kv_t* kvBase;     // pool + elemOffset(block, layer, 0, 0, offset): elemOffset is a sum of one term per
                      // coordinate, so a K/V row adds elemOffset(0, 0, kv, head, 0); unused without kRecordWriteKV
};
constexpr uint32_t kRecordWriteKV = 1u;     // K/V go to the pool (valid page, not superseded in a cyclic ring)
constexpr uint32_t kRecordZeroTail = 2u;    // t ends a prefill chunk: its V writers also zero the rows past it
constexpr uint32_t kRecordLongRope = 4u;    // LongRoPE: the sequence rotates with the long table
constexpr int32_t kRecordTailShift = 8;     // rows of t's page past t (kRecordZeroTail)

constexpr int32_t kMaxChunkTokens = kQKVWriteWarps * kQKVWriteRecordsPerWarp;  // a group of 8: 64 (2 per lane)

// Sets up tokens [base, base + count) (count <= kMaxChunkTokens) into records[0, count): one warp, lane l taking
// tokens base + l and base + l + 32, so that their loads go out together: sequence (a guess exact for decode
// batches and equal chunks; on misses one cooperative search per distinct sequence), then block-table entry, pool
// descriptor and position_ids together: two round trips for the whole chunk (more on guess misses). Raises the status record for an owned token whose page is unusable (its K/V are
// skipped); a token at the edge of two CTAs' windows is reported by both, with the same (seq, page, entry).
template <typename kv_t>
__device__ __forceinline__ void buildTokenRecords(QKVWriteKernelParams const& kp, int32_t base, int32_t count,
                                                  TokenRecord<kv_t>* records, int32_t lane) {
    QKVWriteParams const& p = kp.p;
    StepMetadata const& meta = p.meta;
    KVLayout const& layout = p.layout;
    constexpr int kTokensPerLane = kMaxChunkTokens / 32;
    SeqSpan span[kTokensPerLane];
#pragma unroll
    for (int i = 0; i < kTokensPerLane; ++i)
        span[i] = lane + 32 * i < count ? guessSequence(meta, kp.seqsPerToken, base + lane + 32 * i)
                                        : SeqSpan{-1, 0, 0, 0};
    // Misses: the warp searches the first missing token's sequence; every missing token inside it takes it, and
    // the searched token takes the answer anyway (owned or not: t >= cuQLens[B] is owned by none).
#pragma unroll
    for (int i = 0; i < kTokensPerLane; ++i) {
        int32_t const t = base + lane + 32 * i;
        bool missing = lane + 32 * i < count && !(t >= span[i].begin && t < span[i].end);
        for (uint32_t ballot = __ballot_sync(kFullMask, missing); ballot != 0;
             ballot = __ballot_sync(kFullMask, missing)) {
            int32_t const leader = __ffs(ballot) - 1;
            int32_t const wanted = __shfl_sync(kFullMask, t, leader);
            SeqSpan const found = findSequence(meta, kp.seqsPerToken, wanted, lane);
            if (missing && ((t >= found.begin && t < found.end) || lane == leader)) {
                span[i] = found;
                missing = false;
            }
        }
    }
    // This layer's pool descriptor (engine input kv_pools): address and capacity live in device memory.
    int64_t const* const desc = meta.poolDescs + static_cast<int64_t>(meta.poolIndex) * kPoolDescFields;
    kv_t* const pool = reinterpret_cast<kv_t*>(__ldg(desc + kPoolDescAddress));
    int64_t const poolBlocks = __ldg(desc + kPoolDescNumBlocks);
#pragma unroll
    for (int i = 0; i < kTokensPerLane; ++i) {
        if (lane + 32 * i >= count) continue;
        int32_t const t = base + lane + 32 * i;
        SeqSpan const& s = span[i];
        // Cache position = pastLen + index in the sequence's new tokens: chunk k of a prefill lands after the
        // earlier chunks, never over them.
        bool const owned = t >= s.begin && t < s.end;  // false only for cuQLens[B] <= t: K/V not written
        int32_t const cachePos = s.pastLen + (t - s.begin);
        int32_t const kvLen = s.pastLen + (s.end - s.begin);
        TokenRecord<kv_t> r{p.positionIds != nullptr ? __ldg(p.positionIds + t) : cachePos, 0u, pool};
        // LongRoPE: the whole sequence's new tokens take the long table once its kv length after this step passes
        // the switch (Hugging Face: max(position_ids) + 1 > original_max_positions).
        if (kp.ropeLongAboveKVLen > 0 && kvLen > kp.ropeLongAboveKVLen) r.bits |= kRecordLongRope;
        if (owned) {  // where its K/V go: one block-table load through the contract's locateToken
            BlockTableRow const blockRow{meta.blockTable + static_cast<int64_t>(s.seq) * meta.maxBlocks,
                                         meta.maxBlocks, poolBlocks};
            KVLocation const loc = locateToken(layout, blockRow, cachePos);
            if (loc.block == kInvalidBlock) {
                reportBadPage(p.status, s, t, layout, meta, desc);
            } else {
                // Cyclic ring: when a later token of this same step maps to the same slot, only that one writes
                // (the result of writing in token order, with exactly one writer per slot).
                bool const superseded = layout.cyclicLen > 0 && cachePos >= layout.ringSinkTokens &&
                                        static_cast<int64_t>(cachePos) + layout.cyclicLen < kvLen;
                // After a prefill chunk, the last token's writer of each V row also zeroes the rows past it in the
                // sequence's last page (attention loads whole pages; 0 * NaN = NaN). Not in a wrapped ring: those
                // rows hold live older tokens. Decode tokens (q_len 1) never take this branch. The last token is
                // never superseded.
                bool const wrapped = layout.cyclicLen > 0 &&
                                     static_cast<int64_t>(kvLen) - layout.ringSinkTokens > layout.cyclicLen;
                bool const zeroTail = p.zeroVTail && t == s.end - 1 && s.end - s.begin > 1 && !wrapped;
                if (!superseded) r.bits |= kRecordWriteKV;
                if (zeroTail) r.bits |= kRecordZeroTail;
                r.bits |= static_cast<uint32_t>(layout.pageSize - 1 - loc.offset) << kRecordTailShift;
                r.kvBase = pool + layout.elemOffset(loc.block, p.layer, 0, 0, loc.offset);
            }
        }
        records[lane + 32 * i] = r;
    }
}

// cos/sin of RoPE position `pos` for the lane's 8 dims. The warp computes each frequency once (lane f takes
// frequencies f, f + 32, ..., R/2 <= kMaxRotaryPairs = 4 x 32) into its staging row, then every lane reads its
// dims' pairs: 2 __sincosf per lane for R = 128 instead of 8 (a lane's dims repeat across the row's halves and the
// pass's rows), which matters once a warp enters a token every 3 passes (CTA-interleaved walks).
__device__ __forceinline__ void tokenCosSin(QKVWriteKernelParams const& kp, LaneRow const& r, LaneRope const& lr,
                                            uint64_t const* turns, int32_t pos, float2* table, int32_t lane,
                                            float (&cosv)[kVecElems], float (&sinv)[kVecElems]) {
    float const mscale = kp.p.rope.mscale;
    // dims dim0 + k take frequency freq0 + k (kShuffle) or freq0 + k/2 (kInVector); 0 when dim0 does not rotate
    int32_t const freq0 = ropeElem(kp.p.rope.style, kp.p.rope.rotaryDim, r.dim0).freq;
    __syncwarp();  // the row's earlier readers (a previous token, a kGlobal pass) are done
    for (int32_t f = lane; f < kp.ropeHalf; f += 32) {
        float s;
        float c;
        __sincosf(ropeAngle(pos, turns[f]), &s, &c);
        table[f] = make_float2(c * mscale, s * mscale);
    }
    __syncwarp();
    if (kp.ropePartner == RopePartner::kShuffle) {  // 8 consecutive frequencies from freq0 (a multiple of 8)
        float4 const* const pairs = reinterpret_cast<float4 const*>(table + freq0);
#pragma unroll
        for (int i = 0; i < kVecElems / 2; ++i) {
            float4 const v = pairs[i];
            cosv[2 * i] = v.x;
            sinv[2 * i] = v.y;
            cosv[2 * i + 1] = v.z;
            sinv[2 * i + 1] = v.w;
        }
    } else if (kp.ropePartner == RopePartner::kInVector) {  // GPT-J: dims (2i, 2i + 1) share freq0 + i
        float4 const* const pairs = reinterpret_cast<float4 const*>(table + freq0);
#pragma unroll
        for (int i = 0; i < kVecElems / 4; ++i) {
            float4 const v = pairs[i];
            cosv[4 * i] = cosv[4 * i + 1] = v.x;
            sinv[4 * i] = sinv[4 * i + 1] = v.y;
            cosv[4 * i + 2] = cosv[4 * i + 3] = v.z;
            sinv[4 * i + 2] = sinv[4 * i + 3] = v.w;
        }
    } else {  // kGlobal: a vector may straddle R/2, so each dim looks its frequency up
#pragma unroll
        for (int k = 0; k < kVecElems; ++k) {
            RopeElem const e = ropeElem(kp.p.rope.style, kp.p.rope.rotaryDim, r.dim0 + k);
            float2 const v = e.rotates ? table[e.freq] : make_float2(1.f, 0.f);
            cosv[k] = v.x;
            sinv[k] = v.y;
        }
    }
    // Signs: kShuffle's 8 dims are all firsts or all seconds; GPT-J's firsts are the even dims (unused values of dims
    // that do not rotate are masked out by rotateMask).
    if (kp.ropePartner == RopePartner::kShuffle) {
        float const sign = (lr.firstMask & 1u) ? -1.f : 1.f;
#pragma unroll
        for (int k = 0; k < kVecElems; ++k) sinv[k] *= sign;
    } else if (kp.ropePartner == RopePartner::kInVector) {
#pragma unroll
        for (int k = 0; k < kVecElems; k += 2) sinv[k] = -sinv[k];
    } else {
#pragma unroll
        for (int k = 0; k < kVecElems; ++k) sinv[k] = ((lr.firstMask >> k) & 1u) ? -sinv[k] : sinv[k];
    }
}

// 3 CTAs of 256 threads per SM (<= 80 registers, no spills; ~31 KB of static shared memory each) keep 24 warps
// and, with kPrefetch = 4 copies in flight per thread, 24 x 32 x 4 x 16 B = 48 KB of reads in flight per SM:
// Little's law at the read half of the copy ceiling (~16 B/ns per SM) covers ~3 us of loaded latency.
//
// Stages: prologue (parameter lines, lane constants, the warp's group and walk, its first kPrefetch loads, the
// CTA's RoPE tables); then per round: token set-up (each group's first warp, buildTokenRecords, between CTA
// barriers) and the warps' passes over their group's chunk of tokens: [token entry: its record, cos/sin] -> loader
// (the copy kPrefetch pairs ahead, across tokens and chunks) -> compute (bias, rotation) -> epilogue (q / K / V
// stores, V tail).
//
// kBias: QKV bias (p.bias != nullptr). A compile-time switch rather than a branch: ptxas if-converts a branch on the
// pointer, so that a launch without bias would still issue its ~25 instructions per pass.
template <IODType IO, CacheDType C, bool kBias>
__global__ void __launch_bounds__(kQKVWriteThreads, kQKVWriteMinCTAsPerSM)
    qkvWriteKernel(__grid_constant__ QKVWriteKernelParams const kp) {
    using io_t = typename IOStorage<IO>::type;
    using kv_t = cache_t<C>;
    QKVWriteParams const& p = kp.p;
    QKVWritePlan const& plan = kp.plan;
    KVLayout const& layout = p.layout;

    // ---- prologue ----------------------------------------------------------------------------------------------
    int32_t const warp = threadIdx.x >> 5;
    // The lane index through an identity shuffle: ptxas otherwise re-derives the lane's constants (row, vector,
    // ring address) from the thread index in every pass (~15 instructions) although registers are free.
    int32_t const lane = __shfl_sync(kFullMask, static_cast<int32_t>(threadIdx.x & 31), threadIdx.x & 31);
    // Per warp: one pass of rows for kGlobal partners (32 lanes x 8 dims floats: lane l stages dims [8 l, 8 l + 8)
    // of the pass, the rows' dims and, past the last row, its idle lanes' own words), and at each token entry its
    // (cos, sin) per frequency (R/2 <= 128 float2: the same 1 KB; tokenCosSin orders the two uses).
    __shared__ __align__(16) float stage[kQKVWriteWarps][32 * kVecElems];
    static_assert(kMaxRotaryPairs * 2 <= 32 * kVecElems, "a warp's (cos, sin) table fits its staging row");
    // The parameter lines, fetched together before anything else (warmParameterLines says why). The store is
    // the loads' only use, into this thread's own word of its warp's staging row: the row's first other write
    // (tokenCosSin, a kGlobal pass) follows a __syncwarp, and nothing reads the word before it.
    stage[warp][lane] = __uint_as_float(warmParameterLines(kp));
    LaneRow const lr = laneRow(plan, lane);
    int32_t const headDim = p.headDim;
    int32_t const passes = plan.passesPerToken;  // P
    // Rows [0, H) are Q heads, [H, H+KVH) K heads, [H+KVH, NHR) V heads. Strides and row bounds are plan fields
    // (the constant bank), not locals, so that the loop reads them as operands instead of recomputing them.
    io_t const* const qkv = static_cast<io_t const*>(p.qkv);
    io_t const* const bias = static_cast<io_t const*>(p.bias);

    // My group (qkvWriteGroup: its range of pairs and its window of tokens) and my walk in it.
    QKVWriteGroup const group = qkvWriteGroup(plan, static_cast<int32_t>(blockIdx.x), warp);
    QKVWriteCursor cur = qkvWriteWalk(plan, group, warp);

    // ---- loader: each byte of qkv is read once, 16 bytes per lane, as an asynchronous copy into this thread's
    // column of a shared-memory ring (vec.cuh: copyAsync16 says why not registers), kPrefetch pairs ahead of the
    // processing along the same walk, across token and chunk boundaries. Layout [slot][thread]: a warp's 16-byte
    // accesses are consecutive, conflict-free. The loader's cursor is the consumer's kPrefetch pairs on, so only
    // its token and pass are kept (pairs left: the consumer's minus kPrefetch).
    __shared__ uint4 ring[kRingSlots][kQKVWriteThreads];
    constexpr uint32_t kRingSlotBytes = sizeof(ring[0]);
    uint32_t const myRing = sharedAddress(&ring[0][warp * 32 + lane]);  // my column; slot s at + s * kRingSlotBytes
    int32_t const laneElem = lr.rowSlot * headDim + lr.dim0;      // my vector's element offset within a pass
    // the last pass whose row of mine exists (-1: lanes past the last row never load)
    int32_t const lastLoadPass =
        lr.rowSlot < plan.numHeadRows ? (plan.numHeadRows - 1 - lr.rowSlot) / plan.rowsPerPass : -1;
    QKVWriteCursor ahead = cur;  // the next pair to load (its `left` is not maintained)
    auto const loadPair = [&](int32_t slot, bool inWalk) {
        bool const valid = inWalk && ahead.pass <= lastLoadPass;
        io_t const* src = qkv;  // not read when !valid
        if (valid) src += static_cast<int64_t>(ahead.token) * plan.rowElems + (ahead.pass * plan.passElems + laneElem);
        copyAsync16(myRing + slot * kRingSlotBytes, src, valid);
        commitAsyncCopies();  // one group per pair, also for a zero-fill: the wait below counts groups
        ahead.advance(plan.groupWarps, passes);
    };
#pragma unroll
    for (int k = 0; k < kPrefetch; ++k) loadPair(k, k < cur.left);

    // ---- my group's window, one chunk of token records at a time ----------------------------------------------
    // Group g of W warps keeps records [g W * R, (g + 1) W * R) (R = kQKVWriteRecordsPerWarp); its first warp
    // builds a chunk of up to W * R tokens (2 per lane at most), its warps read them at their token entries. The
    // CTA's groups go through qkvWriteChunkRounds rounds together, one chunk each per round, between CTA barriers
    // (a barrier id held in a register would reserve all 16 of the CTA's). The first chunk is built right away
    // (decode: the kernel is a chain of two round trips, sequence guess then block-table entry), the RoPE tables
    // staged after it, and one barrier publishes both.
    __shared__ TokenRecord<kv_t> records[kQKVWriteWarps * kQKVWriteRecordsPerWarp];
    int32_t const groupFirstWarp = (warp >> plan.groupShift) << plan.groupShift;
    bool const builder = warp == groupFirstWarp;
    TokenRecord<kv_t>* const groupRecords = records + groupFirstWarp * kQKVWriteRecordsPerWarp;
    int32_t const chunkTokens = kQKVWriteRecordsPerWarp * plan.groupWarps;
    int32_t const windowEnd = group.firstToken + group.tokenCount;
    if (builder && group.tokenCount > 0)
        buildTokenRecords<kv_t>(kp, group.firstToken, min(chunkTokens, group.tokenCount), groupRecords, lane);

    // RoPE turns per position by frequency index, in shared memory: [0] kp.ropeTurns, [1] kp.ropeTurnsLong
    // (LongRoPE; tokens of long sequences rotate with it). Warp w copies entries [w * S, w * S + S) of each
    // table; its S loads use warp-uniform indices (one broadcast each, no constant-cache serialization) and are
    // all issued before any is used; ropeTurns' lines were fetched at entry (warmParameterLines).
    __shared__ uint64_t ropeTurnsStaged[2][kMaxRotaryPairs];
    bool const rope = kp.ropePartner != RopePartner::kNone;
    auto const stageTurns = [&](uint64_t const (&table)[kMaxRotaryPairs], uint64_t* staged) {
        constexpr int32_t kTurnsPerWarp = kMaxRotaryPairs / kQKVWriteWarps;
        static_assert(kMaxRotaryPairs % kQKVWriteWarps == 0 && kTurnsPerWarp <= 32, "one lane per staged entry");
        int32_t const firstFreq = warp * kTurnsPerWarp;
        if (firstFreq < kp.ropeHalf) {  // warp-uniform; entries >= R/2 are never read
            uint64_t turns[kTurnsPerWarp];
#pragma unroll
            for (int32_t j = 0; j < kTurnsPerWarp; ++j) turns[j] = table[firstFreq + j];  // < kMaxRotaryPairs
            uint64_t mine = 0;
#pragma unroll
            for (int32_t j = 0; j < kTurnsPerWarp; ++j) mine = lane == j ? turns[j] : mine;
            if (lane < kTurnsPerWarp) staged[firstFreq + lane] = mine;
        }
    };
    if (rope) {
        stageTurns(kp.ropeTurns, ropeTurnsStaged[0]);
        if (kp.ropeLongAboveKVLen > 0) stageTurns(kp.ropeTurnsLong, ropeTurnsStaged[1]);
    }
    LaneRope const lrope = laneRope(kp, lr, lane);
    // Bias element offsets within a row: my vector's, clamped into the row for lanes past the last row (their vec
    // is >= VPH), and my shuffle partner's relative to it (0 where nothing rotates: the partner is the lane itself).
    int32_t const laneBiasDim = min(lr.dim0, headDim - kVecElems);
    int32_t const partnerBiasDelta = (lrope.partnerLane - lane) * kVecElems;

    int32_t const rounds = qkvWriteChunkRounds(plan, static_cast<int32_t>(blockIdx.x));

    // My current token's state (warp-uniform except cos/sin), set at its entry from its record.
    int32_t token = -1;
    bool tokenRope = false;  // RoPE is on and my passes of the token include Q or K rows
    uint32_t bits = 0;       // its record's kRecord* bits
    kv_t* kvBase = nullptr;
    float cosv[kVecElems];  // cos of my dims' angles (x mscale)
    float sinv[kVecElems];  // signed sin: -sin for the first of a pair, +sin for the second
    int32_t readSlot = 0;   // the ring slot of the current pair
    for (int32_t round = 0; round < rounds; ++round) {
        int32_t const chunk = group.firstToken + round * chunkTokens;  // my group's chunk [chunk, chunkEnd)
        int32_t const chunkEnd = min(chunk + chunkTokens, windowEnd);
        if (round > 0) {
            __syncthreads();  // every warp is past the previous round's records
            if (builder && chunk < chunkEnd) buildTokenRecords<kv_t>(kp, chunk, chunkEnd - chunk, groupRecords, lane);
        }
        __syncthreads();  // the round's records (and, in round 0, the RoPE tables) are written

#pragma unroll 1
        for (; cur.left > 0 && cur.token < chunkEnd; cur.advance(plan.groupWarps, passes)) {
            if (cur.token != token) {  // token entry (warp-uniform): its record, its cos/sin
                token = cur.token;
                TokenRecord<kv_t> const rec = groupRecords[token - chunk];
                bits = rec.bits;
                kvBase = rec.kvBase;
                tokenRope = rope && cur.pass * plan.rowsPerPass < plan.vRowBegin;
                if (tokenRope)
                    tokenCosSin(kp, lr, lrope, ropeTurnsStaged[(bits & kRecordLongRope) != 0 ? 1 : 0], rec.ropePos,
                                reinterpret_cast<float2*>(stage[warp]), lane, cosv, sinv);
            }

            // Loader. Groups committed so far: kPrefetch + (pairs processed); leaving kPrefetch - 1 pending
            // completes this pair's. Its slot is read, then the copy kPrefetch pairs ahead goes out into the slot
            // read one pair ago (kRingSlots = kPrefetch + 1), before this row is processed.
            waitAsyncCopies<kPrefetch - 1>();
            uint4 const mine = loadShared16(myRing + readSlot * kRingSlotBytes);
            loadPair(readSlot == 0 ? kRingSlots - 1 : readSlot - 1, cur.left > kPrefetch);
            if (++readSlot == kRingSlots) readSlot = 0;

            // Compute: bias, rotation (Q and K heads).
            int32_t const passRow0 = cur.pass * plan.rowsPerPass;
            int32_t const row = passRow0 + lr.rowSlot;
            bool const inRange = row < plan.numHeadRows;
            bool const passRotates = tokenRope && passRow0 < plan.vRowBegin;  // warp-uniform: a Q/K row in the pass
            bool const rotatesRow = passRotates && row < plan.vRowBegin;
            float x[kVecElems];
            unpack8<io_t>(mine, x);
            // The bias row is small and stays in L1/L2: loaded per row rather than held in registers. Lanes
            // without a row of this pass (they store nothing) read the last row's bias instead, so that no lane
            // condition guards the load.
            int32_t const rowBias = min(row, plan.numHeadRows - 1) * headDim + laneBiasDim;
            if constexpr (kBias) addBias8<io_t>(x, bias + rowBias);
            if (passRotates) {
                float partner[kVecElems];
                if (kp.ropePartner == RopePartner::kShuffle) {
                    // The partner lane holds the same row. Shuffle the packed input (4 words, not 8 floats); every
                    // lane takes part, rows out of range included, as shuffles need the whole warp.
                    uint4 theirs;
                    theirs.x = __shfl_sync(kFullMask, mine.x, lrope.partnerLane);
                    theirs.y = __shfl_sync(kFullMask, mine.y, lrope.partnerLane);
                    theirs.z = __shfl_sync(kFullMask, mine.z, lrope.partnerLane);
                    theirs.w = __shfl_sync(kFullMask, mine.w, lrope.partnerLane);
                    unpack8<io_t>(theirs, partner);
                    if constexpr (kBias) addBias8<io_t>(partner, bias + rowBias + partnerBiasDelta);
                } else if (kp.ropePartner == RopePartner::kInVector) {
#pragma unroll
                    for (int e = 0; e < kVecElems; ++e) partner[e] = x[e ^ 1];
                } else {
                    // kGlobal (NeoX only: GPT-J pairs sit in one vector): the pair distance R/2 is not a whole
                    // number of vectors, so partners straddle two vectors. The warp stages its rows (bias included)
                    // in shared memory and each lane reads its partners by dim (ropeElem's NeoX partner: d +- R/2
                    // below R, else d itself). Rare configurations only; the common ones use a shuffle.
                    float* const rowStage = stage[warp] + lr.slot * headDim;
                    __syncwarp();  // the previous row's (or the cos/sin table's) reads are done
#pragma unroll
                    for (int e = 0; e < kVecElems; ++e) rowStage[lr.dim0 + e] = x[e];
                    __syncwarp();
                    int32_t const half = kp.ropeHalf;
#pragma unroll
                    for (int e = 0; e < kVecElems; ++e) {
                        int32_t const d = lr.dim0 + e;
                        partner[e] = rowStage[d >= 2 * half ? d : d < half ? d + half : d - half];
                    }
                }
                if (rotatesRow && lrope.rotateMask == 0xffu) {  // every dim of my vector (kShuffle: all or none)
#pragma unroll
                    for (int e = 0; e < kVecElems; ++e) x[e] = fmaf(x[e], cosv[e], partner[e] * sinv[e]);
                } else if (rotatesRow) {
#pragma unroll
                    for (int e = 0; e < kVecElems; ++e)
                        if ((lrope.rotateMask >> e) & 1u) x[e] = fmaf(x[e], cosv[e], partner[e] * sinv[e]);
                }
            }
            if (!inRange) continue;

            // Epilogue: the row's store (and the V tail).
            if (row < plan.kvRowBegin) {  // Q head -> qOut[t, row, :]
                int64_t const at = static_cast<int64_t>(token) * plan.qRowElems + (row * headDim + lr.dim0);
                if (p.qOutFP8) {
                    storeQuantized8<CacheDType::kFP8E4M3>(static_cast<__nv_fp8_storage_t*>(p.qOut) + at, x,
                                                          kp.invQScale);
                } else {
                    storeActivation8<io_t>(static_cast<io_t*>(p.qOut) + at, x);
                }
            } else if ((bits & kRecordWriteKV) == 0) {
                // K/V of a token with an unusable page (reported when its record was built) or superseded in a
                // cyclic ring: not written
            } else if (row < plan.vRowBegin) {  // K head
                int32_t const kvHead = row - plan.kvRowBegin;
                storeQuantized8<C>(kvBase + layout.elemOffset(0, 0, 0, kvHead, 0) + lr.dim0, x, kp.invKScale);
            } else {  // V head
                int32_t const kvHead = row - plan.vRowBegin;
                kv_t* const vRow = kvBase + layout.elemOffset(0, 0, 1, kvHead, 0) + lr.dim0;
                storeQuantized8<C>(vRow, x, kp.invVScale);
                if ((bits & kRecordZeroTail) != 0) {
                    // Exactly one writer per (row, head, vector): this lane of the last token's V head.
                    int32_t const tailRows = static_cast<int32_t>(bits >> kRecordTailShift);
                    for (int32_t off = 1; off <= tailRows; ++off)
                        storeZero8<C>(vRow + layout.elemOffset(0, 0, 0, 0, off));
                }
            }
        }
    }
    waitAsyncCopies<0>();  // the zero-fill copies issued past the walk: none outlives the thread
}

// CTAs per SM the kernel can keep resident (occupancy calculator), cached per device.
template <IODType IO, CacheDType C, bool kBias>
int residentCTAsPerSM() {
    static std::mutex mutex;
    static std::vector<int> perDevice;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return 1;
    std::lock_guard<std::mutex> lock(mutex);
    if (device >= static_cast<int>(perDevice.size())) perDevice.resize(device + 1, 0);
    if (perDevice[device] == 0) {
        // The load ring lives in shared memory: ask for a carveout that holds kQKVWriteMinCTAsPerSM CTAs (a
        // hint; the default may favour L1 and leave room for fewer). Half of the SM's unified memory is ample.
        if (cudaFuncSetAttribute(qkvWriteKernel<IO, C, kBias>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 50) != cudaSuccess)
            (void)cudaGetLastError();  // only a hint: do not let its failure surface as the launch's error
        int n = 0;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, qkvWriteKernel<IO, C, kBias>, kQKVWriteThreads, 0);
        perDevice[device] = n > 0 ? n : 1;
    }
    return perDevice[device];
}

// Grid: at most one wave of resident CTAs, whose warps split the (token, pass) pairs into balanced contiguous
// ranges and walk them in groups (qkvWriteGrid in qkv_write_params.cuh chooses how many warps and the group size).
template <IODType IO, CacheDType C, bool kBias>
cudaError_t launchInstance(QKVWriteKernelParams const& kp, int32_t smCount, int32_t groupWarps, cudaStream_t stream) {
    int64_t const residentWarps = static_cast<int64_t>(residentCTAsPerSM<IO, C, kBias>()) * smCount * kQKVWriteWarps;
    QKVWriteKernelParams launch = kp;
    launch.plan = qkvWriteGrid(kp.plan.totalPasses, kp.p.meta.numTokens, residentWarps, groupWarps).apply(kp.plan);
    unsigned const grid = static_cast<unsigned>((launch.plan.numWarps + kQKVWriteWarps - 1) / kQKVWriteWarps);
    if (grid == 0) return cudaSuccess;
    qkvWriteKernel<IO, C, kBias><<<grid, kQKVWriteThreads, 0, stream>>>(launch);
    return cudaGetLastError();
}

}  // namespace qkvwrite

template <IODType IO, CacheDType C>
cudaError_t runQKVWriteKernel(QKVWriteKernelParams const& kp, int32_t smCount, int32_t groupWarps,
                              cudaStream_t stream) {
    return kp.p.bias != nullptr ? qkvwrite::launchInstance<IO, C, true>(kp, smCount, groupWarps, stream)
                                : qkvwrite::launchInstance<IO, C, false>(kp, smCount, groupWarps, stream);
}

}  // namespace pagedkv
