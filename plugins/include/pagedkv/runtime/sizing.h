// Pool sizing: how many blocks of each pool group fit in a memory budget (Python's pagedkv.kvcache.sizing,
// same rules and messages).
#pragma once

#include <cstdint>
#include <vector>

#include "pagedkv/runtime/kv_manager.h"

namespace pagedkv::runtime {

// Blocks per group that fit in `budgetBytes`. `shares` (empty: the same block count for every group, which gets
// floor(budget / sum of block bytes)) are the fractions of the budget each group gets: floor(budget * share /
// block_bytes). Throws KVArgumentError when a group would get no block.
std::vector<int64_t> blocksForBudget(std::vector<PoolGroup> const& groups, int64_t budgetBytes,
                                     std::vector<double> const& shares = {});
// `fraction` in (0, 1] of `freeBytes` (the device's free memory, cudaMemGetInfo).
int64_t budgetFromFreeMemory(double fraction, int64_t freeBytes);

}  // namespace pagedkv::runtime
