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
#include <type_traits>
#include <vector>

#include "cache_convert.cuh"
#include "pagedkv/kv_layout.h"
#include "pagedkv/step_metadata.h"
#include "pdl.cuh"
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

// The sequence owning a token and what the write needs of it. A warp keeps the last one it found: in a
// prefill the next token it handles usually belongs to the same sequence.
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
// where a decode step has nothing else to overlap them with. Skipped: the RoPE frequency tables of the caller's
// parameters (invFreq, longInvFreq: never read by the kernel) and the turns tables (staged in parallel by the
// kernel itself; the last touch below may land in the first line of ropeTurns).
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
    for (size_t at = kAfterFreqTable; at < kTurnsTable + kLine; at += kLine) touched ^= bytes[at];
    return touched;
}

// ---- the kernel's per-warp state and stages (qkvWriteKernel below reads as their data flow) ----------------

// Which row of a warp pass and which 8-element vector of it my lane owns, for the whole kernel. The lanes past the
// pass's last row (VPH not dividing 32) count as vectors past the end of that row: vec >= VPH, dims >= D, so they
// rotate nothing and stage their own words; their head row is out of range (rowSlot), so they load and store
// nothing.
struct LaneGeometry {
    int32_t lane;
    int32_t slot;     // row of the warp pass, lane / VPH (the last row for the lanes past it)
    int32_t vec;      // vector index in that row
    int32_t dim0;     // first head dim of my vector
    int32_t rowSlot;  // head row = pass * RPP + rowSlot; NHR (out of range) for the lanes past the last row

    __device__ __forceinline__ LaneGeometry(int32_t lane_, QKVWritePlan const& plan)
        : lane(lane_),
          slot(min(laneRowOf(lane_, plan.laneRowMagic), plan.rowsPerPass - 1)),
          vec(lane_ - slot * plan.vecsPerRow),
          dim0(vec * kVecElems),
          rowSlot(vec < plan.vecsPerRow ? slot : plan.numHeadRows) {}
};

// Where the head rows of a token sit: in the packed qkv row, in q, and in the bias.
template <typename io_t>
struct HeadRows {
    int32_t headDim;
    int32_t kBegin;  // rows [0, H) Q heads, [H, H+KVH) K heads, [H+KVH, NHR) V heads
    int32_t vBegin;
    int64_t tokenStride;   // elements of a packed qkv token row: NHR * D
    int64_t qTokenStride;  // elements of a q token row: H * D
    io_t const* bias;      // [NHR][D], or null

    __device__ __forceinline__ HeadRows(QKVWriteParams const& p, QKVWritePlan const& plan)
        : headDim(p.headDim),
          kBegin(p.numQHeads),
          vBegin(p.numQHeads + p.numKVHeads),
          tokenStride(static_cast<int64_t>(plan.numHeadRows) * headDim),
          qTokenStride(static_cast<int64_t>(p.numQHeads) * headDim),
          bias(static_cast<io_t const*>(p.bias)) {}
};

// My warp's contiguous, balanced share [begin, end) of the (token, pass) pairs g = t * P + pass; pass `pass` of
// token t is head row pass * rowsPerPass + rowSlot for my lane.
struct WarpRange {
    int32_t passes;  // P, passes per token
    int32_t begin;
    int32_t end;
    __device__ __forceinline__ bool active() const { return begin < end; }  // warp-uniform
};

__device__ __forceinline__ WarpRange warpRangeOf(int32_t warpId, QKVWritePlan const& plan) {
    WarpRange r{plan.passesPerToken, 0, 0};
    if (warpId < plan.numWarps) {
        r.begin = static_cast<int32_t>(static_cast<int64_t>(warpId) * plan.totalPasses / plan.numWarps);
        r.end = static_cast<int32_t>(static_cast<int64_t>(warpId + 1) * plan.totalPasses / plan.numWarps);
    }
    return r;
}

// This layer's pool: its descriptor (engine input kv_pools: address and capacity live in device memory), and
// the address and NB, loaded once per warp into registers.
template <typename kv_t>
struct LayerPool {
    int64_t const* desc;
    kv_t* base = nullptr;
    int64_t numBlocks = 0;

    __device__ __forceinline__ explicit LayerPool(StepMetadata const& meta)
        : desc(meta.poolDescs + static_cast<int64_t>(meta.poolIndex) * kPoolDescFields) {}
    __device__ __forceinline__ void load() {
        base = reinterpret_cast<kv_t*>(__ldg(desc + kPoolDescAddress));
        numBlocks = __ldg(desc + kPoolDescNumBlocks);
    }
};

// The shared-memory ring of a warp's asynchronous 16-byte loads, kPrefetch passes ahead of the processing: one
// commit group per pass, so that with kPrefetch + (passes taken) groups committed, leaving kPrefetch - 1 pending
// completes the oldest. The caller takes a pass's slot, then issues the load kPrefetch passes ahead into the slot
// read one pass ago (its value was consumed, so that read has landed: no write-after-read hazard), before
// processing the row; a thread only reads what its own copies wrote, so no barrier. (vec.cuh: copyAsync16 says
// why shared memory, not registers.)
struct AsyncRing {
    uint4 (&slots)[kRingSlots][kQKVWriteThreads];  // __shared__, [slot][thread]
    int32_t aheadSlot = 0;  // the slot the next copy goes into
    int32_t readSlot = 0;   // the slot of the next pass to take

    // Copies my 16 bytes at `src`, or zero-fills them (!valid: src is not read).
    __device__ __forceinline__ void push(void const* src, bool valid) {
        copyAsync16(&slots[aheadSlot][threadIdx.x], src, valid);
        commitAsyncCopies();  // one group per pass, also for a zero-fill: take() counts groups
        if (++aheadSlot == kRingSlots) aheadSlot = 0;
    }

    // The oldest pass's 16 bytes, once its copy has landed.
    __device__ __forceinline__ uint4 take() {
        waitAsyncCopies<kPrefetch - 1>();
        uint4 const mine = slots[readSlot][threadIdx.x];
        if (++readSlot == kRingSlots) readSlot = 0;
        return mine;
    }
};

// The loads of a warp range (any range of (token, pass) pairs): they run across token boundaries, aheadPassRow
// (and my offset in it) being the pass of the next pair to load.
template <typename io_t>
struct LoadRing {
    AsyncRing ring;
    int32_t aheadPassRow;  // pass x RPP of the next pair to load (warp-uniform)
    int32_t rowLimit;      // NHR - my row slot: my row of the pass is in range while aheadPassRow < rowLimit
    int64_t aheadElem;     // where my 16 bytes of it start in qkv (elements); not read when the row is none
    int32_t aheadLeft;     // pairs left to load

    // The running offset advances by one pass per copy, and by a fixed step to the next token's first pass: adds
    // instead of the token x stride + row x D products per pass (64-bit: ~10 issued instructions of the ~232 a
    // pass cost), all but my row slot warp-uniform.
    __device__ __forceinline__ LoadRing(uint4 (&slots_)[kRingSlots][kQKVWriteThreads], WarpRange const& range,
                                        HeadRows<io_t> const& heads, LaneGeometry const& geo, int32_t rowsPerPass,
                                        int32_t numHeadRows)
        : ring{slots_} {
        int32_t const token = range.begin / range.passes;
        aheadPassRow = (range.begin - token * range.passes) * rowsPerPass;
        rowLimit = numHeadRows - geo.rowSlot;
        aheadElem = static_cast<int64_t>(token) * heads.tokenStride +
                    static_cast<int64_t>(aheadPassRow + geo.rowSlot) * heads.headDim + geo.dim0;
        aheadLeft = range.end - range.begin;
    }

    // Copies my 16 bytes of the next pair's head row, or zero-fills them (row out of range, range exhausted).
    __device__ __forceinline__ void issueNext(QKVWriteKernelParams const& kp, HeadRows<io_t> const& heads,
                                              int32_t passes) {
        int32_t const rowsPerPass = kp.plan.rowsPerPass;
        bool const valid = aheadLeft > 0 && aheadPassRow < rowLimit;
        io_t const* src = static_cast<io_t const*>(kp.p.qkv);  // not read when !valid
        if (valid) src += aheadElem;
        ring.push(src, valid);
        --aheadLeft;
        aheadPassRow += rowsPerPass;
        aheadElem += static_cast<int64_t>(rowsPerPass) * heads.headDim;
        if (aheadPassRow == passes * rowsPerPass) {  // on to the next token's first pass (the same row slot)
            aheadPassRow = 0;
            aheadElem += heads.tokenStride - static_cast<int64_t>(passes * rowsPerPass) * heads.headDim;
        }
    }

    __device__ __forceinline__ uint4 take() { return ring.take(); }
};

// The loads of a warp that owns one whole token (the kTokenWarp kernel): my row of pass p sits p x RPP x D
// elements after my row of pass 0, so one pointer walks them, with no token wrap and no pair count. Nsight Compute
// (benchmarks/NOTES-write.md, rounds 5-7): the range ring's bookkeeping, re-derived by ptxas from the parameter
// bank every pass, was ~50 of a pass's ~176 issued instructions.
template <typename io_t>
struct TokenLoads {
    AsyncRing ring;
    io_t const* next;    // my 16 bytes of the next pass's head row
    io_t const* qkv;     // what a zero-fill copy is given as its (unread) source
    int32_t step;        // RPP x D: from my row of one pass to my row of the next
    int32_t rowsLeft;    // passes left that hold a row of mine: ceil((NHR - my row slot) / RPP), 0 for idle lanes

    __device__ __forceinline__ TokenLoads(uint4 (&slots_)[kRingSlots][kQKVWriteThreads], int32_t token,
                                          QKVWriteKernelParams const& kp, HeadRows<io_t> const& heads,
                                          LaneGeometry const& geo)
        : ring{slots_}, qkv(static_cast<io_t const*>(kp.p.qkv)) {
        int32_t const rowsPerPass = kp.plan.rowsPerPass;
        next = qkv + static_cast<int64_t>(token) * heads.tokenStride +
               static_cast<int64_t>(geo.rowSlot) * heads.headDim + geo.dim0;
        step = rowsPerPass * heads.headDim;
        rowsLeft = (kp.plan.numHeadRows - geo.rowSlot + rowsPerPass - 1) / rowsPerPass;
    }

    // Copies my 16 bytes of the next pass's head row, or zero-fills them (past my last row of the token).
    __device__ __forceinline__ void issueNext() {
        bool const valid = rowsLeft > 0;
        ring.push(valid ? next : qkv, valid);
        --rowsLeft;
        next += step;
    }

    __device__ __forceinline__ uint4 take() { return ring.take(); }
};

// My lane's RoPE constants (they depend on its vector index only, so they are set up once per CTA; per token only
// the angle changes) and the CTA's turns tables in shared memory.
struct RopeLane {
    bool on;              // RoPE is on (uniform)
    bool longRope;        // LongRoPE: long sequences rotate with ropeTurnsLong (uniform)
    uint32_t rotateMask;  // bit k: dim0 + k rotates
    uint32_t firstMask;   // bit k: dim0 + k is the first of its pair (x*cos - partner*sin)
    int32_t partnerLane;  // kShuffle: the lane holding dims dim0 +- R/2 of the same row
    uint64_t const* laneTurns;    // [8][32] __shared__: (k << 5) + vec is what lane `vec` needs for dim vec*8 + k
    uint64_t const* turnsStaged;  // [kMaxRotaryPairs] __shared__, by frequency index (LongRoPE: the long table)
};

// Warp w copies entries [w * S, w * S + S) of a parameter table to shared memory. Its S loads use warp-uniform
// indices (one broadcast each, no constant-cache serialization) and are all issued before any is used, so the
// copy costs one constant-cache miss latency. (Round 2 scanned the whole table in every thread, 8 loads at a
// time: 8 dependent misses after the launch, on the way to the barrier that every warp of the CTA waits at:
// the decode path's critical chain.)
__device__ __forceinline__ void stageTurns(uint64_t (&staged)[kMaxRotaryPairs],
                                           uint64_t const (&table)[kMaxRotaryPairs], QKVWriteKernelParams const& kp,
                                           int32_t warp, int32_t lane) {
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
}

// The CTA's RoPE set-up (every thread calls it: two CTA barriers with rotation, three with LongRoPE, none
// without). laneTurns holds the turns per position laid out [k][vec] (what lane `vec` needs for its dim
// vec*8 + k), so that a warp's reads are conflict-free. ropeTurnsStaged holds a parameter table (kp.ropeTurns,
// then kp.ropeTurnsLong) copied by frequency index: step 1 stages ropeTurns for laneTurns; with LongRoPE, step 3
// then stages ropeTurnsLong there for the token loop.
__device__ __forceinline__ RopeLane setUpRope(QKVWriteKernelParams const& kp, int32_t warp, LaneGeometry const& geo,
                                              uint64_t (&laneTurns)[kVecElems * 32],
                                              uint64_t (&ropeTurnsStaged)[kMaxRotaryPairs]) {
    QKVWriteParams const& p = kp.p;
    bool const rope = kp.ropePartner != RopePartner::kNone;
    bool const longRope = rope && kp.ropeLongAboveKVLen > 0;  // uniform
    static_assert(kVecElems * 32 == kQKVWriteThreads, "one thread per laneTurns entry");
    if (rope) {
        stageTurns(ropeTurnsStaged, kp.ropeTurns, kp, warp, geo.lane);  // step 1
        __syncthreads();
        // Step 2: thread i fills laneTurns entry i = (k, v) from shared memory (dims v * 8 + k >= D never rotate:
        // 0). Entries [0, R/2) were all staged: the 8 warps cover [0, kMaxRotaryPairs) >= R/2.
        int32_t const i = threadIdx.x;
        int32_t const k = i >> 5;
        int32_t const v = i & 31;
        RopeElem const e = ropeElem(p.rope.style, p.rope.rotaryDim, v * kVecElems + k);
        laneTurns[i] = e.rotates ? ropeTurnsStaged[e.freq] : 0;  // freq < R/2 = ropeHalf when it rotates
        __syncthreads();
        if (longRope) {
            // Step 3 (LongRoPE): the long table replaces the staged short one (step 2's reads are behind the
            // barrier). Tokens of long sequences read it by frequency index, once per token (tokenCosSin).
            stageTurns(ropeTurnsStaged, kp.ropeTurnsLong, kp, warp, geo.lane);
            __syncthreads();
        }
    }
    uint32_t rotateMask = 0;
    uint32_t firstMask = 0;
#pragma unroll
    for (int k = 0; k < kVecElems; ++k) {
        RopeElem const e = ropeElem(p.rope.style, p.rope.rotaryDim, geo.dim0 + k);
        rotateMask |= e.rotates ? (1u << k) : 0u;
        firstMask |= (e.rotates && e.first) ? (1u << k) : 0u;
    }
    int32_t partnerLane = geo.lane;
    if (kp.ropePartner == RopePartner::kShuffle && rotateMask != 0) {
        int32_t const laneDelta = kp.ropeHalf / kVecElems;
        partnerLane = geo.dim0 < kp.ropeHalf ? geo.lane + laneDelta : geo.lane - laneDelta;
    }
    return RopeLane{rope, longRope, rotateMask, firstMask, partnerLane, laneTurns, ropeTurnsStaged};
}

// What my rows of the current token need of it, set up when the range enters a new token (warp-uniform except
// cos/sin, which are per lane). The token's sequence is not held here but in the warp's span cache (shared memory).
struct TokenState {
    bool owned = false;  // a sequence owns the token (false only for cuQLens[B] <= t: K/V not written)
    bool rope = false;   // this token's rows in my range include Q or K heads and RoPE is on
    // The block-table entry of the token's page as loaded, unchecked (kInvalidBlock when not looked up). It is
    // checked against the pool only by the token's first K/V row (kvTarget), so the load's round trip overlaps
    // the token's Q passes instead of stalling the warp at the token's entry: under a prefill's load that round
    // trip is a few microseconds, during which the warp issued no new copies.
    int32_t blockEntry = kInvalidBlock;
    int32_t offset = 0;
    bool kvAllowed = false;     // no later token of this step takes the slot (the page's check still applies)
    bool lastOfChunk = false;   // my V rows also zero the rest of the page, if it is usable
    float cosv[kVecElems];
    float sinv[kVecElems];  // signed: -sin for the first of a pair, +sin for the second
};

// The token's page, checked against the pool, and which K/V writes the rules of the step allow.
struct KVTarget {
    int64_t block;  // kInvalidBlock: unusable (or not looked up)
    bool writeKV;   // the page is usable and no later token of this step takes the slot
    bool zeroTail;  // my V rows also zero the rest of the sequence's last page
};
__device__ __forceinline__ KVTarget kvTarget(TokenState const& tok, int64_t poolBlocks) {
    KVTarget target;
    target.block = checkBlockEntry(tok.blockEntry, poolBlocks);
    bool const valid = target.block != kInvalidBlock;
    target.writeKV = valid && tok.kvAllowed;
    target.zeroTail = valid && tok.lastOfChunk;
    return target;
}

// The sequence of token t through the warp's span cache `cached` (warpSpan in the kernel says why shared memory):
// a hit costs no load; a miss runs findSequence with the whole warp and replaces the cached span.
__device__ __forceinline__ SeqSpan lookUpSequence(SeqSpan& cached, StepMetadata const& meta, float seqsPerToken,
                                                  int32_t t, int32_t lane) {
    SeqSpan span = cached;
    if (!(t >= span.begin && t < span.end)) {
        span = findSequence(meta, seqsPerToken, t, lane);
        __syncwarp();  // every lane has read the old span
        if (lane == 0) cached = span;
        __syncwarp();
    }
    return span;
}

// Where token t's K/V go: the block-table load through the contract's locateTokenEntry (checked later, by
// kvTarget), and which writes the rules of the step allow.
__device__ __forceinline__ void locateKV(TokenState& tok, SeqSpan const& span, int32_t t, int32_t cachePos,
                                         int32_t kvLen, QKVWriteKernelParams const& kp, int64_t poolBlocks) {
    QKVWriteParams const& p = kp.p;
    KVLayout const& layout = p.layout;
    StepMetadata const& meta = p.meta;
    BlockTableRow const blockRow{meta.blockTable + static_cast<int64_t>(span.seq) * meta.maxBlocks, meta.maxBlocks,
                                 poolBlocks};
    KVLocation const loc = locateTokenEntry(layout, blockRow, cachePos);
    tok.blockEntry = loc.rawEntry;
    tok.offset = loc.offset;
    // Cyclic ring: when a later token of this same step maps to the same slot, only that one writes (the result
    // of writing in token order, with exactly one writer per slot).
    bool const superseded = layout.cyclicLen > 0 && cachePos >= layout.ringSinkTokens &&
                            static_cast<int64_t>(cachePos) + layout.cyclicLen < kvLen;
    tok.kvAllowed = !superseded;
    // After a prefill chunk, the last token's writer of each V row also zeroes the rows past it in the sequence's
    // last page (attention loads whole pages; 0 * NaN = NaN). Not in a wrapped ring: those rows hold live older
    // tokens. Decode tokens (q_len 1) never take this branch.
    bool const wrapped =
        layout.cyclicLen > 0 && static_cast<int64_t>(kvLen) - layout.ringSinkTokens > layout.cyclicLen;
    tok.lastOfChunk = p.zeroVTail && t == span.end - 1 && span.end - span.begin > 1 && !wrapped;
}

// cos/sin of the token's RoPE position, once for all my rows of it (every Q and K head). Dims that do not rotate
// have turns 0 (cos 1, sin 0, unused): no per-dim branch.
__device__ __forceinline__ void tokenCosSin(TokenState& tok, int32_t t, int32_t cachePos, int32_t kvLen,
                                            QKVWriteKernelParams const& kp, LaneGeometry const& geo,
                                            RopeLane const& rope) {
    QKVWriteParams const& p = kp.p;
    int32_t const ropePos = p.positionIds != nullptr ? __ldg(p.positionIds + t) : cachePos;
    float const mscale = p.rope.mscale;
    // LongRoPE: the whole sequence's new tokens take the long table once its kv length after this step passes
    // the switch (Hugging Face: max(position_ids) + 1 > original_max_positions).
    bool const longTable = rope.longRope && kvLen > kp.ropeLongAboveKVLen;
    bool const pairsShareFreq = kp.ropePartner == RopePartner::kInVector;  // GPT-J: (2i, 2i+1)
#pragma unroll
    for (int k = 0; k < kVecElems; ++k) {
        float s;
        float c;
        if (pairsShareFreq && (k & 1) != 0) {
            c = tok.cosv[k - 1];
            s = -tok.sinv[k - 1];  // undo the first element's sign, reapplied below
        } else {
            uint64_t turns = rope.laneTurns[(k << 5) + geo.vec];
            if (longTable) {  // by frequency index: a rare path, some bank conflicts are fine
                RopeElem const e = ropeElem(p.rope.style, p.rope.rotaryDim, geo.dim0 + k);
                turns = e.rotates ? rope.turnsStaged[e.freq] : 0;
            }
            __sincosf(ropeAngle(ropePos, turns), &s, &c);
            c *= mscale;
            s *= mscale;
        }
        tok.cosv[k] = c;
        tok.sinv[k] = ((rope.firstMask >> k) & 1u) ? -s : s;
    }
}

// A new token t, entered at pass `pass` with `pairsLeft` pairs left in my range: its sequence, page and cos/sin,
// once for all my rows of it. Only what my rows of it need: the sequence when they include K/V heads or when the
// RoPE position comes from it; the page for K/V heads; cos/sin for Q/K heads.
template <typename io_t>
__device__ __forceinline__ void enterToken(TokenState& tok, int32_t t, int32_t pass, int32_t pairsLeft,
                                           int32_t passes, QKVWriteKernelParams const& kp,
                                           HeadRows<io_t> const& heads, LaneGeometry const& geo, RopeLane const& rope,
                                           SeqSpan& warpSpan, int64_t poolBlocks) {
    int32_t const tokenPassEnd = min(passes, pass + pairsLeft);  // my passes of t: [pass, tokenPassEnd)
    bool const needKV = tokenPassEnd * kp.plan.rowsPerPass > heads.kBegin;
    bool const tokenRope = rope.on && pass * kp.plan.rowsPerPass < heads.vBegin;
    tok.rope = tokenRope;

    // Sequence and cache position. Cache position = pastLen + index in the sequence's new tokens: chunk k of a
    // prefill lands after the earlier chunks, never over them.
    tok.owned = false;
    int32_t cachePos = 0;
    int32_t kvLen = 0;
    SeqSpan span{-1, 0, 0, 0};
    // The inner test with `&` / `|`: its operands are plain values, and with `&&` / `||` the compiler re-derived
    // longRope from the parameters here (two more parameter loads per token).
    if (needKV || (tokenRope & ((kp.p.positionIds == nullptr) | rope.longRope))) {
        span = lookUpSequence(warpSpan, kp.p.meta, kp.seqsPerToken, t, geo.lane);
        tok.owned = t >= span.begin && t < span.end;
        cachePos = span.pastLen + (t - span.begin);
        kvLen = span.pastLen + (span.end - span.begin);
    }

    tok.blockEntry = kInvalidBlock;
    tok.offset = 0;
    tok.kvAllowed = false;
    tok.lastOfChunk = false;
    if (needKV && tok.owned) locateKV(tok, span, t, cachePos, kvLen, kp, poolBlocks);

    if (tok.rope) tokenCosSin(tok, t, cachePos, kvLen, kp, geo, rope);
}

// The partner of each of my 8 elements (the element it rotates with) in the same head row. Every lane calls it,
// rows out of range included: the shuffles and the kGlobal path's __syncwarp need the whole warp.
template <typename io_t, bool kBias>
__device__ __forceinline__ void fetchPartners(float (&partner)[kVecElems], uint4 mine, float const (&x)[kVecElems],
                                              io_t const* rowBias, bool rotatesRow, QKVWriteKernelParams const& kp,
                                              HeadRows<io_t> const& heads, LaneGeometry const& geo,
                                              RopeLane const& rope, float (&warpStage)[32 * kVecElems]) {
    if (kp.ropePartner == RopePartner::kShuffle) {
        // The partner lane holds the same row. Shuffle the packed input (4 words, not 8 floats); every lane takes
        // part, rows out of range included, as shuffles need the whole warp.
        uint4 theirs;
        theirs.x = __shfl_sync(kFullMask, mine.x, rope.partnerLane);
        theirs.y = __shfl_sync(kFullMask, mine.y, rope.partnerLane);
        theirs.z = __shfl_sync(kFullMask, mine.z, rope.partnerLane);
        theirs.w = __shfl_sync(kFullMask, mine.w, rope.partnerLane);
        unpack8<io_t>(theirs, partner);
        if constexpr (kBias) {
            if (rowBias != nullptr && rotatesRow)
                addBias8<io_t>(partner, rowBias + geo.dim0 + (rope.partnerLane - geo.lane) * kVecElems);
        }
    } else if (kp.ropePartner == RopePartner::kInVector) {
#pragma unroll
        for (int e = 0; e < kVecElems; ++e) partner[e] = x[e ^ 1];
    } else {
        // kGlobal: the pair distance R/2 is not a whole number of vectors, so partners straddle two vectors. The
        // warp stages its rows (bias included) in shared memory and each lane reads its partners by dim. Rare
        // configurations only; the common ones use a shuffle.
        float* const rowStage = warpStage + geo.slot * heads.headDim;
        __syncwarp();  // the previous row's reads are done
#pragma unroll
        for (int e = 0; e < kVecElems; ++e) rowStage[geo.dim0 + e] = x[e];
        __syncwarp();
#pragma unroll
        for (int e = 0; e < kVecElems; ++e)
            partner[e] = rowStage[ropeElem(kp.p.rope.style, kp.p.rope.rotaryDim, geo.dim0 + e).partnerDim];
    }
}

// My 8 values of head row `row` of the token (`mine`: its packed input): bias, then the rotation for Q and K heads.
// kBias: the step has a bias (the launcher's choice). A run-time null check here would be if-converted by the
// compiler into ~30 predicated-off instructions issued on every pass of a bias-free model (Nsight Compute, H200:
// the pass is ~232 issued instructions, the scheduler 77 % busy), so the bias-free kernel leaves them out.
template <typename io_t, bool kBias>
__device__ __forceinline__ void computeRow(float (&x)[kVecElems], uint4 mine, int32_t row, bool inRange,
                                           QKVWriteKernelParams const& kp, HeadRows<io_t> const& heads,
                                           LaneGeometry const& geo, RopeLane const& rope, TokenState const& tok,
                                           float (&warpStage)[32 * kVecElems]) {
    bool const rotatesRow = tok.rope && row < heads.vBegin;  // Q and K heads
    // The bias row is small and stays in L1/L2: loaded per row rather than held in registers.
    io_t const* rowBias = nullptr;
    if constexpr (kBias) {
        if (inRange) rowBias = heads.bias + static_cast<int64_t>(row) * heads.headDim;  // kBias: bias is non-null
    }
    unpack8<io_t>(mine, x);
    if constexpr (kBias) {
        if (rowBias != nullptr) addBias8<io_t>(x, rowBias + geo.dim0);
    }
    if (tok.rope) {
        float partner[kVecElems];
        fetchPartners<io_t, kBias>(partner, mine, x, rowBias, rotatesRow, kp, heads, geo, rope, warpStage);
        if (rotatesRow) {
#pragma unroll
            for (int e = 0; e < kVecElems; ++e)
                if ((rope.rotateMask >> e) & 1u) x[e] = fmaf(x[e], tok.cosv[e], partner[e] * tok.sinv[e]);
        }
    }
}

// Where my vector of head row `row` of token t goes in q (elements): qOut[t, row, dim0].
template <typename io_t>
__device__ __forceinline__ int64_t qElem(int32_t t, int32_t row, HeadRows<io_t> const& heads, LaneGeometry const& geo) {
    return static_cast<int64_t>(t) * heads.qTokenStride + static_cast<int64_t>(row) * heads.headDim + geo.dim0;
}

// Stores my 8 values of head row `row` (in range) of token t: a Q head to q at element qAt (= qElem(t, row); the
// caller's, as a one-token warp walks it with an add), a K head to the pool (or the token's bad-page report), a V
// head to the pool (and, for the last token of a prefill chunk, the rest of its page zeroed).
template <typename io_t, CacheDType C>
__device__ __forceinline__ void storeRow(float const (&x)[kVecElems], int32_t row, int32_t t, int64_t qAt,
                                         QKVWriteKernelParams const& kp, HeadRows<io_t> const& heads,
                                         LaneGeometry const& geo, TokenState const& tok, SeqSpan const& warpSpan,
                                         LayerPool<cache_t<C>> const& pool) {
    QKVWriteParams const& p = kp.p;
    KVLayout const& layout = p.layout;
    if (row < heads.kBegin) {  // Q head -> qOut[t, row, :]
        int64_t const at = qAt;
        if (p.qOutFP8) {
            storeQuantized8<CacheDType::kFP8E4M3>(static_cast<__nv_fp8_storage_t*>(p.qOut) + at, x, kp.invQScale);
        } else {
            storeActivation8<io_t>(static_cast<io_t*>(p.qOut) + at, x);
        }
    } else if (row < heads.vBegin) {  // K head
        int32_t const kvHead = row - heads.kBegin;
        KVTarget const target = kvTarget(tok, pool.numBlocks);
        // One reporter per token: the lane holding vector 0 of K head 0.
        if (kvHead == 0 && geo.vec == 0 && tok.owned && target.block == kInvalidBlock)
            reportBadPage(p.status, warpSpan, t, layout, p.meta, pool.desc);
        if (target.writeKV)
            storeQuantized8<C>(pool.base + layout.elemOffset(target.block, p.layer, 0, kvHead, tok.offset) + geo.dim0,
                               x, kp.invKScale);
    } else {  // V head
        int32_t const kvHead = row - heads.vBegin;
        KVTarget const target = kvTarget(tok, pool.numBlocks);
        if (target.writeKV)
            storeQuantized8<C>(pool.base + layout.elemOffset(target.block, p.layer, 1, kvHead, tok.offset) + geo.dim0,
                               x, kp.invVScale);
        if (target.zeroTail) {
            // Exactly one writer per (row, head, vector): this lane of the last token's V head.
            for (int32_t off = tok.offset + 1; off < layout.pageSize; ++off)
                storeZero8<C>(pool.base + layout.elemOffset(target.block, p.layer, 1, kvHead, off) + geo.dim0);
        }
    }
}

// The rows of my warp range, any (token, pass) pairs: g walks the range, (token, pass) its pair; a token's
// sequence, page and cos/sin are set up as the range enters it.
template <typename io_t, CacheDType C, bool kBias>
__device__ __forceinline__ void writeRange(WarpRange const& range, LoadRing<io_t>& loads,
                                           QKVWriteKernelParams const& kp, HeadRows<io_t> const& heads,
                                           LaneGeometry const& geo, RopeLane const& rope, SeqSpan& warpSpan,
                                           LayerPool<cache_t<C>> const& pool, float (&warpStage)[32 * kVecElems]) {
    QKVWritePlan const& plan = kp.plan;
    int32_t token = range.begin / range.passes;
    int32_t pass = range.begin - token * range.passes;
    bool newToken = true;
    TokenState tok;
#pragma unroll 1
    for (int32_t g = range.begin; g < range.end; ++g, ++pass) {
        if (pass == range.passes) {
            ++token;
            pass = 0;
            newToken = true;
        }
        if (newToken) {
            newToken = false;
            enterToken<io_t>(tok, token, pass, range.end - g, range.passes, kp, heads, geo, rope, warpSpan,
                             pool.numBlocks);
        }
        // Take pass g's input, then send the load kPrefetch passes ahead into the slot read one pass ago.
        int32_t const row = pass * plan.rowsPerPass + geo.rowSlot;
        uint4 const mine = loads.take();
        loads.issueNext(kp, heads, range.passes);
        bool const inRange = row < plan.numHeadRows;
        float x[kVecElems];
        computeRow<io_t, kBias>(x, mine, row, inRange, kp, heads, geo, rope, tok, warpStage);
        if (!inRange) continue;  // no such head row (idle lane, last pass's tail): it only joined the shuffles
        storeRow<io_t, C>(x, row, token, qElem(token, row, heads, geo), kp, heads, geo, tok, warpSpan, pool);
    }
}

// The rows of my one token (the kTokenWarp kernel): its P passes in order, my row and its place in q advancing
// by a pass each.
template <typename io_t, CacheDType C, bool kBias>
__device__ __forceinline__ void writeToken(int32_t token, TokenLoads<io_t>& loads, QKVWriteKernelParams const& kp,
                                           HeadRows<io_t> const& heads, LaneGeometry const& geo,
                                           RopeLane const& rope, SeqSpan& warpSpan, LayerPool<cache_t<C>> const& pool,
                                           float (&warpStage)[32 * kVecElems]) {
    QKVWritePlan const& plan = kp.plan;
    int32_t const passes = plan.passesPerToken;
    TokenState tok;
    enterToken<io_t>(tok, token, 0, passes, passes, kp, heads, geo, rope, warpSpan, pool.numBlocks);
    int32_t const rowStep = plan.rowsPerPass;
    int32_t const qStep = rowStep * heads.headDim;
    int32_t row = geo.rowSlot;
    int64_t qAt = qElem(token, row, heads, geo);  // past q's row for K/V rows: only read for Q rows
#pragma unroll 1
    for (int32_t pass = 0; pass < passes; ++pass, row += rowStep, qAt += qStep) {
        uint4 const mine = loads.take();
        loads.issueNext();
        bool const inRange = row < plan.numHeadRows;
        float x[kVecElems];
        computeRow<io_t, kBias>(x, mine, row, inRange, kp, heads, geo, rope, tok, warpStage);
        if (!inRange) continue;  // idle lane, last pass's tail: it only joined the shuffles
        storeRow<io_t, C>(x, row, token, qAt, kp, heads, geo, tok, warpSpan, pool);
    }
}

// 3 CTAs of 256 threads per SM (<= 80 registers, no spills; ~31 KB of static shared memory each) keep 24 warps
// and, with kPrefetch = 4 copies in flight per thread, 24 x 32 x 4 x 16 B = 48 KB of reads in flight per SM:
// Little's law at the read half of the copy ceiling (~16 B/ns per SM) covers ~3 us of loaded latency.
// kTokenWarp: the launcher gave every warp exactly one token (plan.numWarps = T; warpRangeOf's ranges are then
// [w P, (w + 1) P)), so the warp walks that token's passes (writeToken) instead of a general range.
template <IODType IO, CacheDType C, bool kBias, bool kTokenWarp>
__global__ void __launch_bounds__(kQKVWriteThreads, kQKVWriteMinCTAsPerSM)
    qkvWriteKernel(__grid_constant__ QKVWriteKernelParams const kp) {
    using io_t = typename IOStorage<IO>::type;
    using kv_t = cache_t<C>;
    using Loads = std::conditional_t<kTokenWarp, TokenLoads<io_t>, LoadRing<io_t>>;
    QKVWritePlan const& plan = kp.plan;
    StepMetadata const& meta = kp.p.meta;

    // The step's attention kernels are launched as programmatic dependents (pdl.cuh) and read nothing before this
    // grid has completed: letting them start as soon as every CTA of this grid is resident hides their launch
    // behind this kernel's last wave.
    gridDependencyLaunchDependents();
    // Prologue: the parameter lines, my lane's place in a warp pass, the shape of a token's rows.
    int32_t const warp = threadIdx.x >> 5;
    int32_t const lane = threadIdx.x & 31;
    // kGlobal partners only: one warp pass of rows (32 lanes x 8 dims floats: lane l stages dims [8 l, 8 l + 8)
    // of the pass, the rows' dims and, past the last row, its idle lanes' own words) per warp.
    __shared__ float stage[kQKVWriteWarps][32 * kVecElems];
    // The parameter lines, fetched together before anything else (warmParameterLines says why). The store is
    // the loads' only use, into this thread's own word of its warp's staging row: the kGlobal path's first
    // write there follows a __syncwarp, and nothing reads the word before that write.
    stage[warp][lane] = __uint_as_float(warmParameterLines(kp));
    LaneGeometry const geo(lane, plan);
    HeadRows<io_t> const heads(kp.p, plan);
    LayerPool<kv_t> pool(meta);

    // My range, first, so that the first loads and the pool descriptor are in flight while the CTA sets up its
    // RoPE table (decode: the kernel is a chain of round trips, and this takes one link off it). And the sequence
    // guess of my first token (exact for decode batches), seeded into the warp's span cache below.
    WarpRange const range = warpRangeOf(static_cast<int32_t>(blockIdx.x) * kQKVWriteWarps + warp, plan);
    int32_t const firstToken = range.begin / range.passes;
    // Layout [slot][thread]: a warp's 16-byte accesses are consecutive, conflict-free.
    __shared__ uint4 ringSlots[kRingSlots][kQKVWriteThreads];
    Loads loads = [&] {
        if constexpr (kTokenWarp) {
            return Loads(ringSlots, firstToken, kp, heads, geo);
        } else {
            return Loads(ringSlots, range, heads, geo, plan.rowsPerPass, plan.numHeadRows);
        }
    }();
    SeqSpan firstGuess{-1, 0, 0, 0};  // empty: no token matches
    if (range.active()) {
#pragma unroll
        for (int k = 0; k < kPrefetch; ++k) {
            if constexpr (kTokenWarp) {
                loads.issueNext();
            } else {
                loads.issueNext(kp, heads, range.passes);
            }
        }
        pool.load();
        firstGuess = guessSequence(meta, kp.seqsPerToken, firstToken);
    }

    // Set-up: the CTA's RoPE table, then the warp's span cache.
    __shared__ uint64_t laneTurns[kVecElems * 32];  // [8][32]: vec < 32 (idle lanes' vec >= VPH read zeros)
    __shared__ uint64_t ropeTurnsStaged[kMaxRotaryPairs];
    RopeLane const rope = setUpRope(kp, warp, geo, laneTurns, ropeTurnsStaged);
    // Each warp's last sequence lookup. It lives in shared memory, not registers: it is read once per token,
    // and 4 registers held across the row loop would cost a CTA of occupancy. It starts as the guess for my
    // first token: a real (seq, cuQLens[seq], cuQLens[seq+1], pastLens[seq]) entry, used only for the tokens
    // it contains, exactly as findSequence would return it for them; a miss searches as usual.
    __shared__ SeqSpan warpSpan[kQKVWriteWarps];
    if (lane == 0) warpSpan[warp] = firstGuess;
    __syncwarp();

    if (!range.active()) return;  // after the CTA barriers above; an inactive warp issued no copies

    // The rows.
    if constexpr (kTokenWarp) {
        writeToken<io_t, C, kBias>(firstToken, loads, kp, heads, geo, rope, warpSpan[warp], pool, stage[warp]);
    } else {
        writeRange<io_t, C, kBias>(range, loads, kp, heads, geo, rope, warpSpan[warp], pool, stage[warp]);
    }
    waitAsyncCopies<0>();  // the zero-fill copies issued past the range: none outlives the thread
}

// CTAs per SM an instance can keep resident (occupancy calculator), cached per device.
template <IODType IO, CacheDType C, bool kBias, bool kTokenWarp>
int residentCTAsPerSM() {
    static std::mutex mutex;
    static std::vector<int> perDevice;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return 1;
    std::lock_guard<std::mutex> lock(mutex);
    if (device >= static_cast<int>(perDevice.size())) perDevice.resize(device + 1, 0);
    if (perDevice[device] == 0) {
        auto const kernel = qkvWriteKernel<IO, C, kBias, kTokenWarp>;
        // The load ring lives in shared memory: ask for a carveout that holds kQKVWriteMinCTAsPerSM CTAs (a
        // hint; the default may favour L1 and leave room for fewer). Half of the SM's unified memory is ample.
        if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 50) != cudaSuccess)
            (void)cudaGetLastError();  // only a hint: do not let its failure surface as the launch's error
        int n = 0;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kQKVWriteThreads, 0);
        perDevice[device] = n > 0 ? n : 1;
    }
    return perDevice[device];
}

// Grid: the CTAs of qkvWriteWarps(...) warps (qkv_write_params.cuh), whose balanced contiguous ranges split the
// (token, pass) pairs: at most one wave of resident CTAs, or for a long prefill one warp per token over many waves
// (the kTokenWarp instance, which also takes any step whose warp count comes out at one per token).
template <IODType IO, CacheDType C, bool kBias>
cudaError_t launchWithBias(QKVWriteKernelParams const& kp, int32_t smCount, cudaStream_t stream) {
    int64_t const residentWarps =
        static_cast<int64_t>(residentCTAsPerSM<IO, C, kBias, false>()) * smCount * kQKVWriteWarps;
    QKVWriteKernelParams launch = kp;
    launch.plan.numWarps = qkvWriteWarps(kp.plan.totalPasses, kp.p.meta.numTokens, residentWarps);
    unsigned const grid = static_cast<unsigned>((launch.plan.numWarps + kQKVWriteWarps - 1) / kQKVWriteWarps);
    if (grid == 0) return cudaSuccess;
    if (launch.plan.numWarps == kp.p.meta.numTokens) {
        (void)residentCTAsPerSM<IO, C, kBias, true>();  // its carveout hint, once
        qkvWriteKernel<IO, C, kBias, true><<<grid, kQKVWriteThreads, 0, stream>>>(launch);
    } else {
        qkvWriteKernel<IO, C, kBias, false><<<grid, kQKVWriteThreads, 0, stream>>>(launch);
    }
    return cudaGetLastError();
}

}  // namespace qkvwrite

// The kernel with or without its bias stage (computeRow says why that is a compile-time choice).
template <IODType IO, CacheDType C>
cudaError_t runQKVWriteKernel(QKVWriteKernelParams const& kp, int32_t smCount, cudaStream_t stream) {
    return kp.p.bias != nullptr ? qkvwrite::launchWithBias<IO, C, true>(kp, smCount, stream)
                                : qkvwrite::launchWithBias<IO, C, false>(kp, smCount, stream);
}

}  // namespace pagedkv
