// The tests' token pools (token_pools.h).
#include "token_pools.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace pagedkv::runtime::check {

TokenPools::TokenPools(KVManager const& m) {
    for (int32_t g = 0; g < m.numGroups(); ++g) {
        KVLayout const& lay = m.group(g).layout;
        layouts_.push_back(lay);
        numBlocks_.push_back(m.allocator(g).numBlocks());
        primary_.emplace_back(size_t(m.allocator(g).numBlocks()) * lay.pageSize, kUnwritten);
        secondary_.emplace_back(size_t(m.allocator(g, Tier::kSecondary).numBlocks()) * lay.pageSize, kUnwritten);
    }
}

void TokenPools::applyCopies(std::vector<BlockCopy> const& copies) {
    for (BlockCopy const& c : copies) {
        int32_t P = layouts_[c.group].pageSize;
        auto& src = c.srcTier == Tier::kPrimary ? primary_[c.group] : secondary_[c.group];
        auto& dst = c.dstTier == Tier::kPrimary ? primary_[c.group] : secondary_[c.group];
        int32_t n = c.numTokens <= 0 ? P : c.numTokens;  // the first n tokens of every row; <= 0: all
        std::copy_n(src.begin() + int64_t(c.srcBlock) * P, n, dst.begin() + int64_t(c.dstBlock) * P);
    }
}

void TokenPools::writeStep(KVManager const& m, StepBatch const& step, std::vector<std::vector<int32_t>> const& tokens) {
    for (int32_t g = 0; g < m.numGroups(); ++g) {
        KVLayout const& lay = layouts_[g];
        int32_t MB = step.plan.maxBlocks[g];
        for (int32_t b = 0; b < step.plan.numSeqs; ++b) {
            BlockTableRow row{step.groups[g].blockTable.data() + int64_t(b) * MB, MB, numBlocks_[g]};
            for (int32_t t = step.cuQLens[b]; t < step.cuQLens[b + 1]; ++t) {
                KVLocation loc = locateToken(lay, row, step.positions[t]);
                if (loc.block == kInvalidBlock)
                    throw std::runtime_error("write: token at position " + std::to_string(step.positions[t]) +
                                             " of step sequence " + std::to_string(b) + " has no page");
                primary_[g][loc.block * lay.pageSize + loc.offset] = tokens[b][t - step.cuQLens[b]];
            }
        }
    }
}

int32_t TokenPools::read(int32_t g, std::vector<int32_t> const& blockList, int32_t pos) const {
    BlockTableRow row{blockList.data(), int32_t(blockList.size()), numBlocks_[g]};
    KVLocation loc = locateToken(layouts_[g], row, pos);
    if (loc.block == kInvalidBlock) return kNoPage;
    return primary_[g][loc.block * layouts_[g].pageSize + loc.offset];
}

}  // namespace pagedkv::runtime::check
