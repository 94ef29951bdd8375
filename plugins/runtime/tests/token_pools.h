// The tests' model of the pools: one token id per slot of every block (both tiers), written where the
// layout contract puts a step's new tokens (locateToken through the step's block table, as the write kernel
// does) and moved by the manager's copy log, so that a test reads every position of a sequence back through
// its block list. A token read from the wrong slot, a missed copy-on-write or a lost page shows as a wrong id.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedkv/runtime/kv_manager.h"

namespace pagedkv::runtime::check {

constexpr int32_t kUnwritten = -1;  // a slot nobody wrote
constexpr int32_t kNoPage = -2;     // read(): the position has no valid page

class TokenPools {
public:
    explicit TokenPools(KVManager const& manager);
    // Run the copies (in order) that the manager recorded since the last drain.
    void applyCopies(std::vector<BlockCopy> const& copies);
    // The step's new tokens: tokens[b] holds sequence b's q_lens[b] ids.
    void writeStep(KVManager const& manager, StepBatch const& step, std::vector<std::vector<int32_t>> const& tokens);
    // Token id stored for `pos` of a sequence with this block list in group g (kNoPage without a page).
    int32_t read(int32_t g, std::vector<int32_t> const& blockList, int32_t pos) const;

private:
    std::vector<KVLayout> layouts_;
    std::vector<int32_t> numBlocks_;
    std::vector<std::vector<int32_t>> primary_, secondary_;  // [G][NB * P]
};

}  // namespace pagedkv::runtime::check
