// Pool-group parameters in one call, for the tests' configurations.
#pragma once

#include <string>

#include "pagedkv/runtime/kv_manager.h"

namespace pagedkv::runtime::check {

inline PoolGroupParams groupParams(std::string name, int32_t layers, int32_t heads, int32_t page, int32_t dim,
                                   PageLayout pageLayout = PageLayout::kHND, int32_t window = 0,
                                   int32_t attentionSinks = 0, int32_t ringSinkTokens = 0, int32_t cyclicLen = 0) {
    PoolGroupParams p;
    p.name = std::move(name);
    p.numLayers = layers;
    p.numKVHeads = heads;
    p.pageSize = page;
    p.headDim = dim;
    p.pageLayout = pageLayout;
    p.window = window;
    p.attentionSinks = attentionSinks;
    p.ringSinkTokens = ringSinkTokens;
    p.cyclicLen = cyclicLen;
    return p;
}

}  // namespace pagedkv::runtime::check
