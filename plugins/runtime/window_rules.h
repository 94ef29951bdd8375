// Which pages a sequence needs, may release, and a step writes: the rules of pagedkv.kvcache.sequences
// (W the attention window, S the sinks, P the page size, L the committed length).
//
// * FULL: all pages_needed(L + R) pages are live.
// * RELEASE: the next query sits at position >= L and sees positions >= L - W + 1 plus the sinks, so after a
//   commit the pages wholly inside [S, L - W + 1) are released; their entries become -1.
// * CYCLIC: the ring holds cyclic_len slots after the sinks (and the bubble that page-aligns it). A step of n
//   new tokens overwrites slots its first query still needs unless cyclic_len >= W + n - 1.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "format.h"
#include "pagedkv/runtime/kv_manager.h"

namespace pagedkv::runtime {

// RELEASE groups: pages [lo, hi) no future query of a sequence of committed `length` can see.
struct PageRange {
    int32_t lo = 0, hi = 0;
};
inline PageRange releasedPageRange(PoolGroup const& spec, int32_t length) {
    if (spec.mode != WindowMode::kRelease) return {};
    int32_t P = spec.pageSize();
    int32_t firstNeeded = std::max(0, length - spec.window + 1);
    int32_t lo = ceilDiv(spec.attentionSinks, P);
    return {lo, std::max(lo, firstNeeded / P)};
}

// Pages (ascending, unique) that writing positions [length, length + count) touches, through the layout's
// token -> slot -> page mapping. A ring step never writes more than the ring (checkCyclicStep first).
inline void writtenPages(PoolGroup const& spec, int32_t length, int32_t count, std::vector<int32_t>& out) {
    out.clear();
    if (count <= 0) return;
    KVLayout const& lay = spec.layout;
    int32_t page, offset;
    if (!lay.cyclicLen) {
        int32_t last;
        lay.slotToPage(length, page, offset);
        lay.slotToPage(length + count - 1, last, offset);
        for (int32_t j = page; j <= last; ++j) out.push_back(j);
        return;
    }
    for (int64_t pos = length; pos < int64_t(length) + count; ++pos) {
        lay.slotToPage(lay.tokenSlot(int32_t(pos)), page, offset);
        out.push_back(page);
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
}

// Tokens of a linear sequence of committed `length` stored in `page` (what a copy must keep). Ring pages
// hold slots of many positions: the whole block counts (page_size).
inline int32_t committedTokensInPage(PoolGroup const& spec, int32_t page, int32_t length) {
    int32_t P = spec.pageSize();
    if (spec.layout.cyclicLen) return P;
    return int32_t(std::min<int64_t>(P, std::max<int64_t>(0, int64_t(length) - int64_t(page) * P)));
}

// A cyclic group's ring must keep the window of the step's first query while the step writes.
inline void checkCyclicStep(PoolGroup const& spec, int32_t count, SeqId seq) {
    if (spec.mode != WindowMode::kCyclic || count <= 0) return;
    int64_t need = int64_t(spec.window) + count - 1;
    if (spec.layout.cyclicLen < need)
        throw KVArgumentError(cat("sequence ", seq, ": cyclic_len=", spec.layout.cyclicLen, " of pool group ",
                                  quoted(spec.name), " is too short for a step of ", count, " new tokens with window=",
                                  spec.window, ": the ring needs cyclic_len >= window + new_tokens - 1 = ", need),
                              seq);
}

}  // namespace pagedkv::runtime
