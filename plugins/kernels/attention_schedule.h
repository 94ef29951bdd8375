// Work decomposition of paged attention, shared by the host plan (attention_plan.cpp), the kernels
// (attention_decode.cu, attention_multi.cu, attention_merge.cu) and the host-side schedule emulator that
// the CPU tests drive (attention_schedule_check.cpp). Everything here is plain integer math (PKV_HD), so the
// emulator runs the very functions the kernels run. Addresses are never computed here: the kernels locate
// cache positions through kv_layout.h (locateToken / elemOffset).
//
//   T tokens, B sequences, H query heads, KVH KV heads, G = H / KVH (query heads per KV head), D head_dim
//
// Query rows. A "row" is one (token, query head of a KV group) pair. Rows are numbered token-major inside a
// KV group: row R = token * G + g, so a tile of rows holds consecutive tokens with all G heads each, and the
// GQA heads that share a KV head share every K/V load (they are packed into the MMA's M dimension).
//
// Kernel classes. A sequence whose rows fit one 16-row MMA tile (qLen * G <= 16: decode, short speculative
// drafts) goes to the decode kernel (one CTA per sequence x KV head x KV chunk, warps split the KV); every
// other sequence goes to the multi-token kernel (tiles of kMultiTileRows rows, warps split the rows and share
// the KV tiles). The class is a pure function of (qLen, G), so each kernel and the merge agree on it
// without any host knowledge of device data.
//
// KV span. The positions a sequence's queries can see form at most two runs: the attention sinks below the
// window [0, nSink) and the window [kvBegin, kvEnd). The "virtual index" v in [0, span) enumerates them in
// order; split-K cuts the virtual range of a sequence into chunks of chunkLen (a multiple of every KV tile
// size), the last chunk of the grid taking whatever remains, so correctness never depends on host bounds.
#pragma once

#include <cstdint>

#include "pagedkv/kv_layout.h"

namespace pagedkv {
namespace attn {

// ---- static shapes of the two kernels (host plan and device code read the same constants)
constexpr int32_t kDecodeWarps = 4;          // the decode CTA width every instance has unless listed below
constexpr int32_t kDecodeRows = 16;         // rows one decode CTA serves: a single m16 MMA tile
constexpr int32_t kDecodeTileTokens = 16;   // KV tokens per warp step (one k16 step of P*V)
constexpr int32_t kDecodeStages = 3;        // cp.async pipeline depth per warp
constexpr int32_t kMultiWarps = 4;
constexpr int32_t kMultiStages = 2;
constexpr int32_t kChunkAlign = 64;         // split-K chunk lengths are multiples of every KV tile size
constexpr int32_t kMinChunkTokens = 256;    // a split chunk is never shorter (per-CTA setup must amortize)
constexpr int32_t kMaxGridChunks = 1024;
constexpr int64_t kMaxPartialRows = 32768;  // workspace budget in (chunk x token x head) rows

// Decode CTA widths (warps per CTA). Every warp streams its own steps through its own pipeline, so the width only
// trades CTAs per SM against warps per CTA (the SM holds ~8 decode warps either way); which one runs best depends
// on the batch (measured on the H200: 16 x 8K wants 8 warps, one unsplit wave; 64 x 4K, 128 x 2K and 256 x 1K 2;
// 32 x 4K, one unsplit wave of 4-warp CTAs, 4), so the plan picks one per launch among the widths compiled for
// the instance and fitting the device:
//   16-bit caches, D <= 128: 2, 4 and 8 warps;
//   8-bit caches, D = 64 and 128 (Frag8 path, 32-token steps): 2 (their 4-warp CTAs were slower: NOTES-attention.md);
//   the rest (8-bit at D = 32, 80, 96, 256; 16-bit at D = 256, whose register budget is spent): 4.
constexpr int32_t kNumDecodeWidths = 3;
constexpr int32_t kDecodeWidthWarps[kNumDecodeWidths] = {2, 4, 8};
// Host-side (the array is not device data); device code asks it in constant expressions only.
constexpr bool isDecodeWidth(int32_t warps) {
    for (int32_t i = 0; i < kNumDecodeWidths; ++i)
        if (kDecodeWidthWarps[i] == warps) return true;
    return false;
}
PKV_HD constexpr bool decodeWidthCompiled(bool cache8Bit, int32_t headDim, int32_t warps) {
    if (cache8Bit) return warps == ((headDim == 64 || headDim == 128) ? 2 : kDecodeWarps);
    return headDim <= 128 ? isDecodeWidth(warps) : warps == kDecodeWarps;
}
// The width an instance has in any case (the others are alternatives the plan may take).
PKV_HD constexpr int32_t decodeDefaultWidth(bool cache8Bit, int32_t headDim) {
    return decodeWidthCompiled(cache8Bit, headDim, kDecodeWarps) ? kDecodeWarps : 2;
}

// m16 tiles per warp in the multi-token kernel: two for D <= 128 (each K/V fragment feeds two MMAs),
// one for D = 256 (register budget).
PKV_HD constexpr int32_t multiWarpMTiles(int32_t headDim) { return headDim == 256 ? 1 : 2; }
PKV_HD constexpr int32_t multiTileRows(int32_t headDim) { return kMultiWarps * 16 * multiWarpMTiles(headDim); }
// The Hopper multi-token kernel's consumer warpgroups, 64 query rows each (sm90/attention_multi_sm90.cuh): one at
// D = 256 (its O takes 128 registers a thread), three in the warp-specialized kernel over 16-bit caches at D = 64 and
// D = 32 (whose rows are padded to 64 elements) -- FlashAttention-3's 192-row tiles: there the softmax's dependent
// chains outlast the MMAs, and a third warpgroup gives the schedulers more warps to switch to; measured 1-7 % faster
// than two at D = 64 and 7-11 % at D = 32 (NOTES-attention.md, twenty-seventh and twenty-eighth sessions) -- two
// otherwise. Its row tile is 64 times that, which the plan takes from DeviceFacts::multiTileRows when that kernel
// runs.
PKV_HD constexpr int32_t sm90ConsumerGroups(bool warpSpecialized, bool cache8Bit, int32_t headDim) {
    return headDim == 256 ? 1 : warpSpecialized && !cache8Bit && (headDim == 64 || headDim == 32) ? 3 : 2;
}
PKV_HD constexpr int32_t sm90TileRows(bool warpSpecialized, bool cache8Bit, int32_t headDim) {
    return 64 * sm90ConsumerGroups(warpSpecialized, cache8Bit, headDim);
}
// KV tokens per pipeline stage of the multi-token kernel (its S / softmax steps stay 32 tokens wide).
PKV_HD constexpr int32_t multiTileTokens(int32_t headDim) { return headDim <= 128 ? 64 : 32; }
// Row width, in elements, of both kernels' 16-bit shared-memory tiles (Q, K, V as the MMAs read them). Their
// XOR swizzle permutes a row's 16-byte chunks within aligned groups of 8 and steps through a row by XOR-ing the
// k-step into the chunk index, so a row holds a power of two >= 8 chunks: D = 64, 128, 256 as they are; the
// other head dims in rows of the next of those widths (D = 32 -> 64, D = 80 and 96 -> 128), whose chunks past D
// are never written nor read. The MMAs, the loads and the copies still cover D only; the padding costs shared
// memory, never bandwidth.
PKV_HD constexpr int32_t tileRowElems(int32_t headDim) {
    return headDim <= 64 ? 64 : headDim <= 128 ? 128 : 256;
}

PKV_HD int32_t minI32(int32_t a, int32_t b) { return a < b ? a : b; }
PKV_HD int32_t maxI32(int32_t a, int32_t b) { return a > b ? a : b; }

// Which kernel serves a sequence with qLen new tokens and G query heads per KV head.
PKV_HD bool isDecodeClass(int32_t qLen, int32_t groupSize) {
    return groupSize <= kDecodeRows && qLen * groupSize <= kDecodeRows;
}

// ---- one sequence of the step
struct SeqInfo {
    int32_t qStart;   // first token index in [0, T)
    int32_t qLen;     // new tokens this step
    int32_t pastLen;  // cached before this step: query i sits at position pastLen + i
    int32_t kvLen;    // pastLen + qLen: the cache length after this step's write
};

PKV_HD SeqInfo makeSeqInfo(int32_t const* cuQLens, int32_t const* pastLens, int32_t b) {
    SeqInfo s;
    s.qStart = cuQLens[b];
    s.qLen = cuQLens[b + 1] - s.qStart;
    s.pastLen = pastLens[b];
    s.kvLen = s.pastLen + s.qLen;
    return s;
}

// Sequence of token t: the last b with cuQLens[b] <= t (that sequence is never empty, since
// cuQLens[b + 1] > t). Binary search; B is at most a few thousand.
PKV_HD int32_t seqOfToken(int32_t const* cuQLens, int32_t numSeqs, int32_t t) {
    int32_t lo = 0, hi = numSeqs - 1;
    while (lo < hi) {
        int32_t mid = (lo + hi + 1) >> 1;
        if (cuQLens[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

// First position the window of a query at qPos covers (0 without a window).
PKV_HD int32_t windowStart(int32_t qPos, int32_t window) {
    return window > 0 ? maxI32(0, qPos - window + 1) : 0;
}

// Visibility of one (query, kv) pair for the kernels: kvPos < 0 marks a row that holds nothing (outside the
// chunk, past the sequence, or on an absent page), which no query sees.
PKV_HD bool kvVisible(int32_t qPos, int32_t kvPos, int32_t window, int32_t attentionSinks) {
    return kvPos >= 0 && attends(qPos, kvPos, window, attentionSinks);
}

// ---- the KV span of a sequence: sinks [0, nSink) then the window run [kvBegin, kvEnd)
struct KVSpan {
    int32_t nSink;
    int32_t kvBegin;
    int32_t kvEnd;

    PKV_HD int32_t size() const { return nSink + (kvEnd - kvBegin); }
    // virtual index -> cache position
    PKV_HD int32_t position(int32_t v) const { return v < nSink ? v : kvBegin + (v - nSink); }
    // cache position -> virtual index, for positions in the span; used for range ends (exclusive), where a
    // position in the gap [nSink, kvBegin) means "the end of the sinks".
    PKV_HD int32_t virtualEnd(int32_t pos) const { return pos <= kvBegin ? minI32(pos, nSink) : nSink + (pos - kvBegin); }
};

// The span covers every position any query of the sequence sees (the first query has the lowest window).
PKV_HD KVSpan seqSpan(SeqInfo const& s, int32_t window, int32_t attentionSinks) {
    KVSpan sp;
    sp.kvEnd = s.kvLen;
    sp.kvBegin = windowStart(s.pastLen, window);
    sp.nSink = window > 0 ? minI32(maxI32(attentionSinks, 0), sp.kvBegin) : 0;
    return sp;
}

// ---- split-K chunks of a sequence's span
struct ChunkRange {
    int32_t begin;  // virtual indices [begin, end)
    int32_t end;
};

// Chunks a span of `span` virtual indices is cut into, never more than the grid provides.
PKV_HD int32_t numChunks(int32_t span, int32_t chunkLen, int32_t gridChunks) {
    if (gridChunks <= 1 || span <= chunkLen) return 1;
    int64_t n = (int64_t(span) + chunkLen - 1) / chunkLen;
    return n < gridChunks ? int32_t(n) : gridChunks;
}

// Chunk z of n: [z * chunkLen, (z + 1) * chunkLen), the last one extended to the end of the span.
PKV_HD ChunkRange chunkRange(int32_t z, int32_t n, int32_t span, int32_t chunkLen) {
    ChunkRange c;
    c.begin = n == 1 ? 0 : z * chunkLen;
    c.end = (z == n - 1) ? span : c.begin + chunkLen;
    return c;
}

// ---- the KV tiles (of tileTokens virtual indices, tile k = [k*tileTokens, (k+1)*tileTokens)) that rows with
// query positions in [qa, qb] may need inside chunk `ch`: the sink run and the window run, as two disjoint
// ascending tile ranges. Every needed tile is listed exactly once; per-element masking does the rest.
struct KVTileList {
    int32_t aBegin, aEnd;  // tile indices of the first run
    int32_t bBegin, bEnd;  // tile indices of the second run (bBegin >= aEnd)

    PKV_HD int32_t count() const { return (aEnd - aBegin) + (bEnd - bBegin); }
    PKV_HD int32_t tile(int32_t k) const {
        int32_t na = aEnd - aBegin;
        return k < na ? aBegin + k : bBegin + (k - na);
    }
};

PKV_HD KVTileList kvTilesFor(KVSpan const& sp, int32_t qa, int32_t qb, int32_t window, int32_t attentionSinks,
                             ChunkRange const& ch, int32_t tileTokens) {
    int32_t lo = windowStart(qa, window);  // lowest window position of the rows (>= sp.kvBegin)
    int32_t vHi = sp.virtualEnd(qb + 1);   // causal end of the last row
    int32_t vLo = window > 0 ? sp.virtualEnd(lo) : 0;
    int32_t vSinkEnd = (window > 0 && attentionSinks > 0) ? sp.virtualEnd(minI32(attentionSinks, lo)) : 0;
    // runs in virtual indices, clipped to the chunk
    int32_t a0 = maxI32(0, ch.begin), a1 = minI32(vSinkEnd, ch.end);
    int32_t b0 = maxI32(maxI32(vLo, vSinkEnd), ch.begin), b1 = minI32(vHi, ch.end);
    KVTileList t;
    if (a1 > a0) {
        t.aBegin = a0 / tileTokens;
        t.aEnd = (a1 + tileTokens - 1) / tileTokens;
    } else {
        t.aBegin = t.aEnd = 0;
    }
    if (b1 > b0) {
        t.bBegin = maxI32(b0 / tileTokens, t.aEnd);  // a tile shared by both runs is listed once
        t.bEnd = maxI32((b1 + tileTokens - 1) / tileTokens, t.bBegin);
    } else {
        t.bBegin = t.bEnd = t.aEnd;
    }
    return t;
}

// ---- the multi-token kernel's row tiles. Tile slots [0, numBodyTiles) cut the global row space
// [0, T*G) into aligned tiles of tileRows; a body tile belongs to the sequence that owns its first row and
// stops at that sequence's end. Slots [numBodyTiles, numBodyTiles + B) are head tiles: sequence b's rows
// from its first row up to the next aligned boundary. Together they cover every row exactly once.
struct RowTile {
    int32_t seq;
    int32_t rowBegin;  // global rows [rowBegin, rowEnd), all of `seq`; empty when rowBegin >= rowEnd
    int32_t rowEnd;
};

PKV_HD int32_t numBodyTiles(int32_t numTokens, int32_t groupSize, int32_t tileRows) {
    return int32_t((int64_t(numTokens) * groupSize + tileRows - 1) / tileRows);
}

PKV_HD RowTile multiRowTile(int32_t slot, int32_t bodyTiles, int32_t tileRows, int32_t groupSize,
                            int32_t const* cuQLens, int32_t numSeqs) {
    RowTile r;
    if (slot >= bodyTiles) {
        r.seq = slot - bodyTiles;
        int32_t start = cuQLens[r.seq] * groupSize;
        int32_t end = cuQLens[r.seq + 1] * groupSize;
        int32_t aligned = (start + tileRows - 1) / tileRows * tileRows;
        r.rowBegin = start;
        r.rowEnd = minI32(aligned, end);
        return r;
    }
    int32_t begin = slot * tileRows;
    int32_t numTokens = cuQLens[numSeqs];
    if (begin >= numTokens * groupSize) {
        r.seq = 0;
        r.rowBegin = r.rowEnd = 0;
        return r;
    }
    r.seq = seqOfToken(cuQLens, numSeqs, begin / groupSize);
    r.rowBegin = begin;
    r.rowEnd = minI32(begin + tileRows, cuQLens[r.seq + 1] * groupSize);
    return r;
}

// ---- the plan values the kernels and the merge need (filled by planAttention on the host)
struct SplitPlan {
    int32_t decodeChunkLen;   // virtual indices per split chunk of a decode-class sequence
    int32_t decodeGridChunks; // grid.z of the decode kernel (1: no split)
    int32_t multiChunkLen;
    int32_t multiGridChunks;
    int32_t multiBodyTiles;
    int32_t multiLaunched;    // 0: the plan assumed no sequence needs the multi-token kernel (maxQLen * G <= 16)
};

// Chunks of sequence s, as both the attention kernel that serves it and the merge see them.
PKV_HD int32_t seqChunks(SplitPlan const& plan, SeqInfo const& s, int32_t groupSize, int32_t window,
                         int32_t attentionSinks) {
    KVSpan sp = seqSpan(s, window, attentionSinks);
    return isDecodeClass(s.qLen, groupSize) ? numChunks(sp.size(), plan.decodeChunkLen, plan.decodeGridChunks)
                                            : numChunks(sp.size(), plan.multiChunkLen, plan.multiGridChunks);
}

// Cache position of the query in global row R (token R / G) of sequence s.
PKV_HD int32_t rowQueryPos(SeqInfo const& s, int32_t row, int32_t groupSize) {
    return s.pastLen + (row / groupSize - s.qStart);
}

// ---- what one CTA does: the decisions both kernels take before touching memory, in one place, so that the
// host emulator (attention_schedule_check.cpp) replays exactly the kernels' decisions.
struct CtaWork {
    bool active;       // false: nothing to do (other kernel's sequence, empty tile, chunk past the span)
    int32_t seqIndex;  // b
    bool poison;       // decode kernel only: the sequence needed the multi-token kernel, which the plan did not
                       // launch (maxQLen was not a bound): its rows are filled with NaN, never left stale
    SeqInfo seq;
    KVSpan span;
    int32_t nChunks;
    ChunkRange chunk;
    KVTileList tiles;
    int32_t rowBegin;  // global rows [rowBegin, rowEnd) this CTA serves
    int32_t rowEnd;
};

struct StepView {  // the step metadata and attention settings the decisions read
    int32_t const* cuQLens;
    int32_t const* pastLens;
    int32_t numSeqs;
    int32_t groupSize;
    int32_t window;
    int32_t attentionSinks;
};

// Whether thread `tid` of `threads` sees a sequence of the step that the multi-token kernel serves: it reads
// sequences tid, tid + threads, ... (a CTA ORs its threads' answers: one coalesced read of cu_q_lens).
PKV_HD bool seesMultiTokenSequence(StepView const& v, int32_t tid, int32_t threads) {
    for (int32_t b = tid; b < v.numSeqs; b += threads)
        if (!isDecodeClass(v.cuQLens[b + 1] - v.cuQLens[b], v.groupSize)) return true;
    return false;
}

// Decode kernel CTA (sequence b, any KV head, chunk z): all rows of the sequence.
PKV_HD CtaWork decodeCtaWork(SplitPlan const& plan, StepView const& v, int32_t b, int32_t z) {
    CtaWork w{};
    w.seqIndex = b;
    w.seq = makeSeqInfo(v.cuQLens, v.pastLens, b);
    w.rowBegin = w.seq.qStart * v.groupSize;
    w.rowEnd = (w.seq.qStart + w.seq.qLen) * v.groupSize;
    if (w.seq.qLen <= 0) return w;
    if (!isDecodeClass(w.seq.qLen, v.groupSize)) {
        w.poison = !plan.multiLaunched && z == 0;
        return w;
    }
    w.span = seqSpan(w.seq, v.window, v.attentionSinks);
    w.nChunks = numChunks(w.span.size(), plan.decodeChunkLen, plan.decodeGridChunks);
    if (z >= w.nChunks) return w;
    w.chunk = chunkRange(z, w.nChunks, w.span.size(), plan.decodeChunkLen);
    w.tiles =
        kvTilesFor(w.span, w.seq.pastLen, w.seq.kvLen - 1, v.window, v.attentionSinks, w.chunk, kDecodeTileTokens);
    w.active = true;
    return w;
}

// Multi-token kernel CTA (row tile `slot`, any KV head, chunk z).
PKV_HD CtaWork multiCtaWork(SplitPlan const& plan, StepView const& v, int32_t tileRows, int32_t tileTokens,
                            int32_t slot, int32_t z) {
    CtaWork w{};
    RowTile rt = multiRowTile(slot, plan.multiBodyTiles, tileRows, v.groupSize, v.cuQLens, v.numSeqs);
    w.rowBegin = rt.rowBegin;
    w.rowEnd = rt.rowEnd;
    if (rt.rowBegin >= rt.rowEnd) return w;
    w.seqIndex = rt.seq;
    w.seq = makeSeqInfo(v.cuQLens, v.pastLens, rt.seq);
    if (isDecodeClass(w.seq.qLen, v.groupSize)) return w;
    w.span = seqSpan(w.seq, v.window, v.attentionSinks);
    w.nChunks = numChunks(w.span.size(), plan.multiChunkLen, plan.multiGridChunks);
    if (z >= w.nChunks) return w;
    w.chunk = chunkRange(z, w.nChunks, w.span.size(), plan.multiChunkLen);
    int32_t qa = rowQueryPos(w.seq, rt.rowBegin, v.groupSize);
    int32_t qb = rowQueryPos(w.seq, rt.rowEnd - 1, v.groupSize);
    w.tiles = kvTilesFor(w.span, qa, qb, v.window, v.attentionSinks, w.chunk, tileTokens);
    w.active = true;
    return w;
}

// ---- persistent multi-token CTAs (the Hopper warp-specialized kernel). The other multi-token kernels launch one
// CTA per cell of the grid (x: row-tile slot X - 1 - x, longest first; y: KV head; z: chunk), so a CTA's set-up
// (metadata, Q, the first tiles' page lookups and loads) and tear-down are never overlapped on its SM. The
// persistent kernel launches persistentCtas() CTAs that walk the cells instead: its producer loads the next cell's
// first tiles while the consumers finish the current one. Cells are dealt one group at a time (a (KV head, chunk)
// pair: one sweep of the row tiles, the order the hardware dispatches a grid in), so that the CTAs work on one KV
// head together and its K/V stays in L2; within a group snake-wise (round r of `ctas` cells to CTAs 0, 1, ... for
// even r and back for odd r: a CTA's long row tiles pair with short ones), the group's first CTA rotated on by the
// cells dealt before it. A static deal needs no counter in global memory (nothing to reset between launches, no
// workspace). Modeled against the hardware's greedy dispatch on the bench's shapes (NOTES-attention.md,
// seventeenth session): within 1 % of it, where dealing cells round-robin is 5-30 % off.
struct MultiCell {
    int32_t slot;
    int32_t kvHead;
    int32_t z;
};

PKV_HD int32_t persistentCtas(int64_t cells, int32_t smCount, int32_t ctasPerSm) {
    int64_t const resident = int64_t(smCount > 0 ? smCount : 1) * (ctasPerSm > 0 ? ctasPerSm : 1);
    return int32_t(cells < resident ? (cells > 0 ? cells : 1) : resident);
}

struct PersistentDeal {
    int32_t cellsX;   // X = multiBodyTiles + B: row-tile slots of a group
    int32_t kvHeads;  // Y
    int32_t groups;   // Y x Z
    int32_t ctas;
    int32_t cta;
    int32_t group;    // the walk: the group being dealt and this CTA's round in it
    int32_t round;

    // This CTA's next cell, in the order it serves them; false once none is left.
    PKV_HD bool next(MultiCell& cell) {
        while (group < groups) {
            int32_t const first = int32_t((int64_t(group) * cellsX) % ctas);  // the CTA that takes the group's x = 0
            int32_t const j = cta >= first ? cta - first : cta - first + ctas;  // this CTA's place in each round
            int64_t const x = int64_t(round) * ctas + ((round & 1) ? ctas - 1 - j : j);
            if (x < cellsX) {
                ++round;
                cell.slot = cellsX - 1 - int32_t(x);
                cell.kvHead = group % kvHeads;
                cell.z = group / kvHeads;
                return true;
            }
            ++group;
            round = 0;
        }
        return false;
    }
};

PKV_HD PersistentDeal persistentDeal(SplitPlan const& plan, int32_t numSeqs, int32_t numKVHeads, int32_t ctas,
                                     int32_t cta) {
    PersistentDeal d{};
    d.cellsX = plan.multiBodyTiles + numSeqs;
    d.kvHeads = numKVHeads;
    d.groups = numKVHeads * plan.multiGridChunks;
    d.ctas = ctas;
    d.cta = cta;
    return d;
}

// What virtual index v of a CTA's chunk holds: its cache position and location, or pos = -1 when it holds
// nothing (outside the chunk, or its page is absent: -1, out of range or past the block-table row). The
// kernels' loaders and the emulator both call this; a row with pos = -1 is zero-filled and never seen.
struct KVRow {
    int32_t pos;
    KVLocation loc;
};

// kvRowAt in two steps (locateTokenEntry / resolveBlock): kvRowEntryAt requests the block-table entry and
// leaves pos as the candidate position (-1 outside the chunk); resolveKVRow checks the entry and sets pos to
// -1 when the page is absent. The kernels' loaders call the first a tile before the second.
PKV_HD KVRow kvRowEntryAt(KVLayout const& layout, BlockTableRow const& table, KVSpan const& sp, ChunkRange const& ch,
                          int32_t v) {
    KVRow r;
    r.pos = -1;
    r.loc.block = kInvalidBlock;
    r.loc.offset = 0;
    r.loc.rawEntry = kInvalidBlock;
    r.loc.pageInSeq = -1;
    if (v >= ch.begin && v < ch.end) {
        r.pos = sp.position(v);
        r.loc = locateTokenEntry(layout, table, r.pos);
    }
    return r;
}
PKV_HD void resolveKVRow(BlockTableRow const& table, KVRow& r) {
    resolveBlock(table, r.loc);
    if (r.loc.block == kInvalidBlock) r.pos = -1;
}

PKV_HD KVRow kvRowAt(KVLayout const& layout, BlockTableRow const& table, KVSpan const& sp, ChunkRange const& ch,
                     int32_t v) {
    KVRow r = kvRowEntryAt(layout, table, sp, ch, v);
    resolveKVRow(table, r);
    return r;
}

// Multi-token kernel fast path: a KV tile needs no per-element mask when every row of it holds a position,
// all of them causal for the earliest query (pMax <= qa) and inside the window of the latest one.
PKV_HD bool tileNeedsMask(bool allRowsHold, int32_t pMin, int32_t pMax, int32_t qa, int32_t qb, int32_t window) {
    if (!allRowsHold || pMax > qa) return true;
    return window > 0 && pMin < qb - window + 1;
}

}  // namespace attn
}  // namespace pagedkv
