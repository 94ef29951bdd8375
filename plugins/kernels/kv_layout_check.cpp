#include "pagedkv/kv_layout_check.h"

namespace pagedkv {
namespace {

FieldIssue issue(char const* field, int64_t value, std::string expected) {
    return FieldIssue{field, value, std::move(expected)};
}

std::string asBuilt(int64_t v) { return std::to_string(v) + " (as makeKVLayout builds it from the geometry)"; }

}  // namespace

FieldIssue checkKVLayoutGeometry(int32_t numLayers, int32_t numKVHeads, int32_t pageSize, int32_t headDim,
                                 PageLayout pageLayout, int32_t ringSinkTokens, int32_t cyclicLen) {
    if (numLayers <= 0) return issue("num_layers", numLayers, "> 0");
    if (numKVHeads <= 0) return issue("num_kv_heads", numKVHeads, "> 0");
    if (pageSize <= 0) return issue("page_size", pageSize, "> 0");
    if (headDim <= 0) return issue("head_dim", headDim, "> 0");
    if (pageLayout != PageLayout::kHND && pageLayout != PageLayout::kNHD)
        return issue("page_layout", static_cast<int32_t>(pageLayout), "0 (HND) or 1 (NHD)");
    if (ringSinkTokens < 0) return issue("ring_sink_tokens", ringSinkTokens, ">= 0");
    if (cyclicLen < 0 || cyclicLen % pageSize != 0)
        return issue("cyclic_len", cyclicLen,
                     "0 or a positive multiple of page_size=" + std::to_string(pageSize) +
                         " (the ring is whole pages)");
    return {};  // exactly what makeKVLayout accepts
}

FieldIssue checkKVLayoutFor(KVLayout const& l, int32_t numKVHeads, int32_t headDim, int32_t layer) {
    if (FieldIssue bad = checkKVLayoutGeometry(l.numLayers, l.numKVHeads, l.pageSize, l.headDim, l.pageLayout,
                                               l.ringSinkTokens, l.cyclicLen))
        return bad;
    if (l.numKVHeads != numKVHeads)
        return issue("layout.num_kv_heads", l.numKVHeads, "num_kv_heads=" + std::to_string(numKVHeads));
    if (l.headDim != headDim) return issue("layout.head_dim", l.headDim, "head_dim=" + std::to_string(headDim));
    if (layer < 0 || layer >= l.numLayers)
        return issue("layer_index", layer, "in [0, num_layers=" + std::to_string(l.numLayers) + ")");
    KVLayout e;  // the valid geometry above is what makeKVLayout accepts
    makeKVLayout(l.numLayers, l.numKVHeads, l.pageSize, l.headDim, l.pageLayout, l.ringSinkTokens, l.cyclicLen, e);
    if (l.pageShift != e.pageShift) return issue("layout.page_shift", l.pageShift, asBuilt(e.pageShift));
    if (l.ringSinkTokens != e.ringSinkTokens)
        return issue("layout.ring_sink_tokens", l.ringSinkTokens, asBuilt(e.ringSinkTokens));
    if (l.bubbleLen != e.bubbleLen) return issue("layout.bubble_len", l.bubbleLen, asBuilt(e.bubbleLen));
    if (l.strideBlock != e.strideBlock) return issue("layout.stride_block", l.strideBlock, asBuilt(e.strideBlock));
    if (l.strideLayer != e.strideLayer) return issue("layout.stride_layer", l.strideLayer, asBuilt(e.strideLayer));
    if (l.strideKV != e.strideKV) return issue("layout.stride_kv", l.strideKV, asBuilt(e.strideKV));
    if (l.strideHead != e.strideHead) return issue("layout.stride_head", l.strideHead, asBuilt(e.strideHead));
    if (l.strideToken != e.strideToken) return issue("layout.stride_token", l.strideToken, asBuilt(e.strideToken));
    return {};
}

}  // namespace pagedkv
