// Block allocator (block_allocator.h): the same list order as pagedkv.kvcache.allocator.BlockAllocator.
#include "pagedkv/runtime/block_allocator.h"

#include "format.h"

namespace pagedkv::runtime {

BlockAllocator::BlockAllocator(int32_t numBlocks, std::string name, Tier tier)
    : numBlocks_(numBlocks), name_(std::move(name)), tier_(tier), sentinel_(numBlocks) {
    if (numBlocks < 0) throw KVArgumentError(cat("num_blocks: must be >= 0, got ", numBlocks), std::nullopt);
    int32_t n = numBlocks;
    refcount_.assign(n, 0);
    // Initially every block is free, in id order: head -> 0 -> 1 -> ... -> n-1 -> sentinel.
    next_.resize(n + 1);
    prev_.resize(n + 1);
    for (int32_t b = 0; b < n; ++b) {
        next_[b] = b + 1;
        prev_[b] = b == 0 ? n : b - 1;
    }
    next_[n] = 0;  // n == 0: the sentinel links to itself
    prev_[n] = n ? n - 1 : 0;
    numFree_ = n;
}

void BlockAllocator::checkId(int32_t block) const {
    if (block < 0 || block >= numBlocks_)
        throw KVArgumentError(
            cat(name_, " (", tierName(tier_), "): block id ", block, " outside [0, ", numBlocks_, ")"), std::nullopt);
}

int32_t BlockAllocator::refcount(int32_t block) const {
    checkId(block);
    return refcount_[block];
}

void BlockAllocator::allocate(int32_t count, std::vector<int32_t>& out, std::optional<SeqId> seq,
                              std::string const& what) {
    if (count < 0) throw KVArgumentError(cat("count: must be >= 0, got ", count), seq);
    if (count > numFree_) throw KVCacheExhaustedError(count, numFree_, name_, tier_, seq, what);
    for (int32_t i = 0; i < count; ++i) {
        int32_t b = next_[sentinel_];
        unlink(b);
        refcount_[b] = 1;
        out.push_back(b);
    }
}

void BlockAllocator::incref(int32_t block) {
    checkId(block);
    if (refcount_[block] == 0) unlink(block);
    ++refcount_[block];
}

bool BlockAllocator::decref(int32_t block) {
    checkId(block);
    int32_t rc = refcount_[block];
    if (rc <= 0)
        throw BlockRefcountError(cat(name_, " (", tierName(tier_), "): block ", block,
                                     " released while free (refcount ", rc, "): double free"),
                                 block, rc);
    refcount_[block] = rc - 1;
    if (rc == 1) {
        linkTail(block);
        return true;
    }
    return false;
}

std::vector<int32_t> BlockAllocator::freeList() const {
    std::vector<int32_t> out;
    for (int32_t b = next_[sentinel_]; b != sentinel_; b = next_[b]) {
        if (b < 0 || b > numBlocks_ || int32_t(out.size()) >= numBlocks_)
            throw BlockRefcountError(cat(name_, ": free list has a cycle"), b,
                                     b >= 0 && b < numBlocks_ ? refcount_[b] : 0);
        out.push_back(b);
    }
    return out;
}

std::vector<int32_t> BlockAllocator::freeListBackwards() const {
    std::vector<int32_t> out;
    for (int32_t b = prev_[sentinel_]; b != sentinel_; b = prev_[b]) {
        if (b < 0 || b > numBlocks_ || int32_t(out.size()) >= numBlocks_)
            throw BlockRefcountError(cat(name_, ": free list has a cycle (backwards)"), b,
                                     b >= 0 && b < numBlocks_ ? refcount_[b] : 0);
        out.push_back(b);
    }
    return out;
}

void BlockAllocator::unlink(int32_t b) {
    int32_t p = prev_[b], n = next_[b];
    next_[p] = n;
    prev_[n] = p;
    prev_[b] = next_[b] = -1;
    --numFree_;
}

void BlockAllocator::linkTail(int32_t b) {
    int32_t s = sentinel_;
    int32_t last = prev_[s];
    next_[last] = b;
    prev_[b] = last;
    next_[b] = s;
    prev_[s] = b;
    ++numFree_;
}

bool BlockAllocator::operator==(BlockAllocator const& o) const {
    return numBlocks_ == o.numBlocks_ && name_ == o.name_ && tier_ == o.tier_ && refcount_ == o.refcount_ &&
           next_ == o.next_ && prev_ == o.prev_ && numFree_ == o.numFree_;
}

}  // namespace pagedkv::runtime
