// copy_plan.h: Python's copy_plan, line for line.
#include "pagedkv/runtime/copy_plan.h"

#include <stdexcept>

#include "format.h"
#include "pagedkv/runtime/kv_errors.h"

namespace pagedkv::runtime {

CopyPlan copyPlan(KVLayout const& layout, int32_t itemsize, int32_t numTokens) {
    int64_t const blockBytes = layout.strideBlock * itemsize;
    if (numTokens <= 0 || numTokens >= layout.pageSize) {
        if (numTokens > layout.pageSize)
            throw KVArgumentError(cat("num_tokens: ", numTokens, " exceeds page_size=", layout.pageSize), std::nullopt);
        return {1, blockBytes, blockBytes};
    }
    int64_t const rowElems = int64_t(layout.pageSize) * layout.strideToken;
    if (layout.strideBlock % rowElems)  // the layout contract is broken, not the caller's input
        throw std::logic_error(cat("layout: a block (", layout.strideBlock, " elements) is not whole rows of ", rowElems,
                                   " tokens*stride_token elements"));
    return {layout.strideBlock / rowElems, rowElems * itemsize, int64_t(numTokens) * layout.strideToken * itemsize};
}

}  // namespace pagedkv::runtime
