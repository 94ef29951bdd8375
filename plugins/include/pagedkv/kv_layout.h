// pagedkv KV-layout contract: the ONE place where token -> (block, offset) -> address is computed.
//
// Every kernel that touches a KV pool (the QKV-write kernel, the attention kernels) and the host-side code that
// builds and validates launches (makeKVLayout here, its named checks in kv_layout_check.h) go through the
// helpers below. The Python twin is `src/pagedkv/layout.py` (the references, the KV manager and its block
// copies use it); `tests/test_layout.py` checks that both compute the same layouts and addresses.
// The seed's main lesson: the write side and the read side must call the same mapping function.
// docs/kv_layout.md explains the choices.
//
// Dimension legend
//   L    layers in one pool group (a block holds all of them, as in TensorRT-LLM)
//   KVH  KV heads, D head_dim, P page_size (tokens per block), NB blocks in the pool
//   B    sequences in a step, MB max blocks per sequence (block-table width)
//
// Pool of one pool group (one allocation), elements of the cache dtype:
//   HND (default): [NB, L, 2, KVH, P, D]   (2 = K then V)
//   NHD (option) : [NB, L, 2, P, KVH, D]
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PKV_HD __host__ __device__ __forceinline__
#else
#define PKV_HD inline
#endif

namespace pagedkv {

// Storage dtype of the pool. Values are part of the ONNX/plugin contract (attribute `cache_dtype`).
enum class CacheDType : int32_t {
    kFP16 = 0,
    kBF16 = 1,
    kFP8E4M3 = 2,  // per-layer K and V scales: x ~= stored * scale
    kINT8 = 3,     // per-layer K and V scales: x ~= stored * scale
    kNVFP4 = 4,    // reserved: 2 values per byte + fp8 block scales per 16 values + global K/V scales
};

// Order of the token and head dimensions inside one (block, layer, K|V) slab.
enum class PageLayout : int32_t {
    kHND = 0,  // [KVH, P, D]: one head's page is contiguous (P*D elements) -> the read side streams it
    kNHD = 1,  // [P, KVH, D]: one token's heads are contiguous
};

// Bytes of one stored element (Python's CacheDType.itemsize).
PKV_HD int32_t cacheDTypeBytes(CacheDType c) { return (c == CacheDType::kFP16 || c == CacheDType::kBF16) ? 2 : 1; }

constexpr int32_t kInvalidBlock = -1;  // block-table sentinel: no page here (evicted / not allocated)

// log2(x) when x is a power of two, else -1. Host-side helper; the device reads the cached value.
PKV_HD int32_t log2IfPow2(int32_t x) {
    if (x <= 0 || (x & (x - 1)) != 0) return -1;
    int32_t s = 0;
    while ((1 << s) < x) ++s;
    return s;
}

PKV_HD int32_t ceilDiv(int32_t a, int32_t b) { return (a + b - 1) / b; }

// Length formula shared by the KV manager and the read side: (pages - 1) * P + last_page_len.
PKV_HD int32_t lengthFromPages(int32_t numPages, int32_t lastPageLen, int32_t pageSize) {
    return numPages == 0 ? 0 : (numPages - 1) * pageSize + lastPageLen;
}
PKV_HD int32_t lastPageLen(int32_t length, int32_t pageSize) {
    return length == 0 ? 0 : (length - 1) % pageSize + 1;
}

// Geometry of one pool group plus its cyclic-window parameters. Build it with makeKVLayout (host).
// All strides are in elements of the cache dtype.
// The C API takes this struct as it is (plugins/capi): it stays a standard-layout POD, and a member added here
// needs its entry in capi/capi_structs.cpp (the build fails until it has one).
struct KVLayout {
    int32_t numLayers;
    int32_t numKVHeads;
    int32_t pageSize;
    int32_t headDim;
    int32_t pageShift;  // log2(pageSize) for power-of-two pages (shift + mask), -1 -> divmod
    PageLayout pageLayout;
    // Cyclic window (the seed's getKVTokenIdx). cyclicLen == 0: linear cache, slot == position.
    // Otherwise positions < ringSinkTokens keep their slot; later positions wrap in a ring of cyclicLen slots
    // that starts after the sinks plus a bubble that aligns the ring to a page boundary.
    int32_t ringSinkTokens;
    int32_t cyclicLen;
    int32_t bubbleLen;
    int64_t strideBlock;
    int64_t strideLayer;
    int64_t strideKV;
    int64_t strideHead;
    int64_t strideToken;

    // Logical cache position -> logical slot in the sequence's block list (TensorRT-LLM getKVTokenIdx).
    PKV_HD int32_t tokenSlot(int32_t pos) const {
        if (cyclicLen == 0 || pos < ringSinkTokens) return pos;
        return ringSinkTokens + bubbleLen + (pos - ringSinkTokens) % cyclicLen;
    }

    // Slots a sequence of `length` tokens occupies (the block list must cover ceilDiv(slots, P) pages).
    PKV_HD int32_t slotsUsed(int32_t length) const {
        if (cyclicLen == 0 || length <= ringSinkTokens) return length;
        int32_t ring = length - ringSinkTokens;
        return ringSinkTokens + bubbleLen + (ring < cyclicLen ? ring : cyclicLen);
    }

    // Block-list entries a sequence of `length` tokens needs (the Python twin's pages_needed). 64-bit
    // rounding: the KV manager asks for lengths up to 2^31 - 1.
    PKV_HD int32_t pagesNeeded(int32_t length) const {
        return int32_t((int64_t(slotsUsed(length)) + pageSize - 1) / pageSize);
    }

    // Slot -> (page index within the sequence, offset within the page): shift and mask or divmod.
    PKV_HD void slotToPage(int32_t slot, int32_t& pageInSeq, int32_t& offset) const {
        if (pageShift >= 0) {
            pageInSeq = slot >> pageShift;
            offset = slot & ((1 << pageShift) - 1);
        } else {
            pageInSeq = slot / pageSize;
            offset = slot - pageInSeq * pageSize;
        }
    }

    // Element offset of (block, layer, kv, head, offset-in-page, 0) from the pool base.
    PKV_HD int64_t elemOffset(int64_t block, int32_t layer, int32_t kv, int32_t head, int32_t offset) const {
        return block * strideBlock + layer * strideLayer + kv * strideKV + head * strideHead +
               offset * strideToken;
    }
};

// Host: fill a KVLayout. Returns false (and leaves `out` untouched) for invalid geometry.
inline bool makeKVLayout(int32_t numLayers, int32_t numKVHeads, int32_t pageSize, int32_t headDim,
                         PageLayout pageLayout, int32_t ringSinkTokens, int32_t cyclicLen, KVLayout& out) {
    if (numLayers <= 0 || numKVHeads <= 0 || pageSize <= 0 || headDim <= 0) return false;
    if (ringSinkTokens < 0 || cyclicLen < 0) return false;
    if (cyclicLen > 0 && cyclicLen % pageSize != 0) return false;  // the ring is made of whole pages
    KVLayout l{};
    l.numLayers = numLayers;
    l.numKVHeads = numKVHeads;
    l.pageSize = pageSize;
    l.headDim = headDim;
    l.pageShift = log2IfPow2(pageSize);
    l.pageLayout = pageLayout;
    l.ringSinkTokens = cyclicLen > 0 ? ringSinkTokens : 0;
    l.cyclicLen = cyclicLen;
    int32_t sinkInLastPage = l.ringSinkTokens % pageSize;
    l.bubbleLen = (cyclicLen == 0 || sinkInLastPage == 0) ? 0 : pageSize - sinkInLastPage;
    int64_t slab = int64_t(numKVHeads) * pageSize * headDim;
    if (pageLayout == PageLayout::kHND) {
        l.strideToken = headDim;
        l.strideHead = int64_t(pageSize) * headDim;
    } else {
        l.strideToken = int64_t(numKVHeads) * headDim;
        l.strideHead = headDim;
    }
    l.strideKV = slab;
    l.strideLayer = 2 * slab;
    l.strideBlock = int64_t(numLayers) * 2 * slab;
    out = l;
    return true;
}

// A block-table entry checked against the pool's NB blocks: the block, or kInvalidBlock for -1 and out-of-range ids.
PKV_HD int64_t checkBlockEntry(int32_t b, int64_t numBlocks) {
    return (b < 0 || b >= numBlocks) ? int64_t(kInvalidBlock) : int64_t(b);
}

// One sequence's row of the block table, with the pool capacity for the range check.
struct BlockTableRow {
    int32_t const* blocks;  // [MB]
    int32_t maxBlocks;      // MB
    int64_t numBlocks;      // NB: ids >= NB are out of range

    // Physical block of the page holding `pageInSeq`, or kInvalidBlock when the entry is -1, out of range,
    // or past the row. Callers must never dereference a kInvalidBlock.
    PKV_HD int64_t block(int32_t pageInSeq) const { return checkEntry(entry(pageInSeq)); }
    // The two halves of block(): the raw entry (kInvalidBlock past the row) and its check against the pool.
    PKV_HD int32_t entry(int32_t pageInSeq) const {
        return (pageInSeq >= 0 && pageInSeq < maxBlocks) ? blocks[pageInSeq] : int32_t(kInvalidBlock);
    }
    PKV_HD int64_t checkEntry(int32_t b) const { return checkBlockEntry(b, numBlocks); }
};

// Where cache position `pos` of a sequence lives. Both the write and the read side call this.
struct KVLocation {
    int64_t block;   // physical block id, or kInvalidBlock
    int32_t offset;  // token offset inside the page
    int32_t rawEntry;  // the block-table entry as found (for error reports), or kInvalidBlock past the row
    int32_t pageInSeq;
};

// locateToken in two steps, for kernels that request the block-table entry early and use it a tile later (the
// load's round trip then overlaps compute): locateTokenEntry fills pageInSeq, offset and rawEntry and leaves
// block unresolved; resolveBlock checks the entry against the row and the pool.
PKV_HD KVLocation locateTokenEntry(KVLayout const& layout, BlockTableRow const& row, int32_t pos) {
    KVLocation loc;
    int32_t slot = layout.tokenSlot(pos);
    layout.slotToPage(slot, loc.pageInSeq, loc.offset);
    loc.rawEntry = row.entry(loc.pageInSeq);
    loc.block = kInvalidBlock;
    return loc;
}
PKV_HD void resolveBlock(BlockTableRow const& row, KVLocation& loc) { loc.block = row.checkEntry(loc.rawEntry); }

PKV_HD KVLocation locateToken(KVLayout const& layout, BlockTableRow const& row, int32_t pos) {
    KVLocation loc = locateTokenEntry(layout, row, pos);
    resolveBlock(row, loc);
    return loc;
}

// Attention visibility shared by the reference and the kernels: query at cache position qPos sees kvPos
// when it is causal and either inside the window of the `window` most recent positions (qPos included)
// or one of the `attentionSinks` first positions. window <= 0: full causal attention.
PKV_HD bool attends(int32_t qPos, int32_t kvPos, int32_t window, int32_t attentionSinks) {
    if (kvPos > qPos) return false;
    if (window <= 0) return true;
    return (qPos - kvPos < window) || (kvPos < attentionSinks);
}

}  // namespace pagedkv
