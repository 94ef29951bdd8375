// Block allocator of one pool group and tier: reference counts and a free list, O(1) per block. The twin of
// `pagedkv.kvcache.allocator.BlockAllocator`, with the same list order, so that both managers hand out the
// same block ids for the same operations.
//
// The free list is doubly linked through two int arrays (`prev_`/`next_`, sentinel at index numBlocks), so
// a block can leave it from the middle (a prefix hit reviving a free cached block). Blocks are handed out
// from the head and returned to the tail: the blocks freed longest ago are reused (and their cached
// prefixes evicted) first. A block is free exactly when its refcount is 0.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagedkv/runtime/kv_errors.h"

namespace pagedkv::runtime {

class BlockAllocator {
public:
    BlockAllocator(int32_t numBlocks, std::string name, Tier tier);

    int32_t numBlocks() const { return numBlocks_; }
    int32_t numFree() const { return numFree_; }
    int32_t numUsed() const { return numBlocks_ - numFree_; }
    std::string const& name() const { return name_; }
    Tier tier() const { return tier_; }
    int32_t refcount(int32_t block) const;
    std::vector<int32_t> const& refcounts() const { return refcount_; }

    // Take `count` free blocks (refcount 1 each) from the head, appended to `out`. Throws
    // KVCacheExhaustedError (naming `seq` and `what`) before touching anything when fewer are free.
    void allocate(int32_t count, std::vector<int32_t>& out, std::optional<SeqId> seq = std::nullopt,
                  std::string const& what = "");
    // One more holder; a free block (a cached prefix block) leaves the free list.
    void incref(int32_t block);
    // One holder less; returns true when the block became free (appended to the tail). A block released
    // while free throws BlockRefcountError ("double free").
    bool decref(int32_t block);

    // The free list walked from the head (next handed out) to the tail, or backwards. Throws
    // BlockRefcountError when the links form a cycle (corruption; the validator reports it).
    std::vector<int32_t> freeList() const;
    std::vector<int32_t> freeListBackwards() const;

    bool operator==(BlockAllocator const& other) const;

private:
    friend struct AllocatorTestAccess;  // the validator's tests corrupt the links on purpose
    void checkId(int32_t block) const;
    void unlink(int32_t block);
    void linkTail(int32_t block);

    int32_t numBlocks_;
    std::string name_;
    Tier tier_;
    int32_t sentinel_;
    std::vector<int32_t> refcount_;
    std::vector<int32_t> next_, prev_;  // [numBlocks + 1], -1 for held blocks
    int32_t numFree_;
};

}  // namespace pagedkv::runtime
