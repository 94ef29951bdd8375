// The C++ KV manager: the bookkeeping of `pagedkv.kvcache.KVCacheManager` (host model, storage="none") with
// the same semantics, so that the C++ runtime and the Python runtime hand out the same blocks, build the
// same block tables and the same step metadata, and fail the same way (docs/runtime-cpp.md;
// tests/test_kvcache_native.py runs both on one random trace).
//
// Pool groups, sequences with a committed length L and a reservation R (block list of pages_needed(L + R)
// entries), chunked prefill as reserve/commit pairs, fork with copy-on-write at reserve, prefix reuse of
// full blocks (exact chained keys, token comparison on a hit, LRU eviction through the free list), windows
// released page by page (RELEASE) or kept in a ring (CYCLIC), and a secondary tier for swap_out/swap_in.
// Every operation plans, checks all groups, then acts: an exception means nothing changed.
//
// No memory is touched: each block copy the bookkeeping decides (copy-on-write, offload, reload) is
// appended to the copy log as a BlockCopy; a device backend executes them (in order, before the step's
// kernels) and drains the log. The index math is the layout contract's (pagedkv/kv_layout.h).
//
// Not thread-safe, not even the const queries (planStep keeps scratch): one manager per scheduler thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pagedkv/kv_layout.h"
#include "pagedkv/runtime/block_allocator.h"
#include "pagedkv/runtime/kv_errors.h"
#include "pagedkv/runtime/step_batch.h"

namespace pagedkv::runtime {

enum class WindowMode : int32_t {
    kFull = 0,     // full causal attention: every page stays
    kRelease = 1,  // sliding window on a linear cache: pages that leave the window are released (-1)
    kCyclic = 2,   // sliding window on a ring (KVLayout::cyclicLen): slots are reused in place
};

// One pool group (the twin of PoolGroup): its layout, cache dtype, attention window and sinks.
// Build it with makePoolGroup, which checks it like the Python spec does.
struct PoolGroup {
    std::string name;
    KVLayout layout;
    CacheDType cacheDType = CacheDType::kFP16;
    int32_t window = 0;          // 0: full causal
    int32_t attentionSinks = 0;  // always-visible first positions (window > 0 only)
    WindowMode mode = WindowMode::kFull;
    int32_t ringPages = 0;  // cyclic: the most pages a sequence ever holds (sinks + bubble + ring)
    int32_t pageSize() const { return layout.pageSize; }
    int32_t itemsize() const { return cacheDTypeBytes(cacheDType); }
    int64_t blockBytes() const { return layout.strideBlock * itemsize(); }  // all layers, K and V, all heads
};

struct PoolGroupParams {
    std::string name;
    int32_t numLayers = 0, numKVHeads = 0, pageSize = 0, headDim = 0;
    PageLayout pageLayout = PageLayout::kHND;
    int32_t ringSinkTokens = 0;  // layout sinks (cyclic rings only)
    int32_t cyclicLen = 0;   // 0: linear cache
    CacheDType cacheDType = CacheDType::kFP16;
    int32_t window = 0;
    int32_t attentionSinks = 0;
};

// Throws KVArgumentError naming the field, the value and the group.
PoolGroup makePoolGroup(PoolGroupParams const& params);

// Copy the first `numTokens` tokens (<= 0: the whole block) of every (layer, K/V, head) of one block to
// another block of the same pool group, possibly across tiers (Python's BlockCopy).
struct BlockCopy {
    int32_t group;
    Tier srcTier;
    int32_t srcBlock;
    Tier dstTier;
    int32_t dstBlock;
    int32_t numTokens;
    bool operator==(BlockCopy const& o) const {
        return group == o.group && srcTier == o.srcTier && srcBlock == o.srcBlock && dstTier == o.dstTier &&
               dstBlock == o.dstBlock && numTokens == o.numTokens;
    }
};

struct GroupStats {
    int32_t numBlocks, numFree;    // primary tier
    int32_t hostBlocks, hostFree;  // secondary tier
    int32_t numCached;             // blocks registered in the prefix cache (held or free)
};

class KVManager {
public:
    // `numBlocks` / `hostBlocks`: one count per group (hostBlocks empty: no secondary tier).
    KVManager(std::vector<PoolGroup> groups, std::vector<int64_t> const& numBlocks,
              std::vector<int64_t> const& hostBlocks = {}, bool enablePrefixReuse = false);
    ~KVManager();
    KVManager(KVManager const& other);  // deep copy (tests snapshot a manager around failing calls)
    KVManager& operator=(KVManager const& other);
    KVManager(KVManager&&) noexcept;
    KVManager& operator=(KVManager&&) noexcept;
    bool operator==(KVManager const& other) const;  // same bookkeeping, copy log included

    // ---- groups ----
    int32_t numGroups() const;
    PoolGroup const& group(int32_t g) const;
    bool prefixReuse() const;
    BlockAllocator const& allocator(int32_t g, Tier tier = Tier::kPrimary) const;
    GroupStats stats(int32_t g) const;
    std::vector<int32_t> cachedBlocks(int32_t g) const;  // registered prefix blocks, ascending

    // ---- sequences ----
    // Start a sequence; with prefix reuse, cached full blocks matching the prompt are shared (never all of
    // it: its last token is always computed). Returns the tokens reused (= the committed length).
    int32_t addSequence(SeqId seq, int32_t const* promptTokens, int32_t promptLen, std::string const& salt = {});
    // Room for `numTokens` new tokens after the committed length: allocates pages, copy-on-write of shared
    // pages they land in. Idempotent for a large enough reservation.
    void reserve(SeqId seq, int32_t numTokens);
    // reserve(seqs[i], counts[i]) for every i, all-or-nothing (Python's reserve_many): the sequences are checked
    // (known, live, distinct), then every group's blocks for all of them (new pages and copy-on-write, counted
    // as sequential reserves would take them; a ring group counts every written page), and only then reserved
    // in order. KVCacheExhaustedError (seq unset) when any group lacks blocks: nothing changed.
    void reserveMany(SeqId const* seqs, int32_t const* counts, int32_t n);
    void unreserve(SeqId seq);
    // `numTokens` reserved tokens are in the cache now; `tokenIds` (null: unknown) extend the known tokens
    // (prefix hashing only): `tokenCount` ids, which must be numTokens (-1: numTokens, unchecked). RELEASE
    // groups release pages that left the window; full blocks are registered.
    void commit(SeqId seq, int32_t numTokens, int32_t const* tokenIds = nullptr, int64_t tokenCount = -1);
    void free(SeqId seq);
    void fork(SeqId src, SeqId dst);
    void swapOut(SeqId seq);
    void swapIn(SeqId seq);

    // ---- queries ----
    bool contains(SeqId seq) const;
    int32_t numSequences() const;
    std::vector<SeqId> sequences() const;  // in the order they were added
    int32_t length(SeqId seq) const;
    int32_t reserved(SeqId seq) const;
    int32_t promptLength(SeqId seq) const;
    int32_t prefillRemaining(SeqId seq) const;
    bool isSwapped(SeqId seq) const;
    // The sequence's block list in group g: pages_needed(L + R) entries, -1 where released or swapped out.
    std::vector<int32_t> const& blockList(SeqId seq, int32_t g) const;

    // ---- block copies ----
    std::vector<BlockCopy> const& copyLog() const;
    std::vector<BlockCopy> drainCopies();

    // ---- step metadata (step_batch.h) ----
    void planStep(StepEntry const* entries, int32_t count, StepPlan& plan) const;
    void writeStep(StepPlan const& plan, StepBuffers const& out) const;
    void buildStep(StepEntry const* entries, int32_t count, StepBatch& out) const;
    // The `kv_pools` engine input: INT64 [G, kPoolDescFields], row g = (addresses[g], num_blocks[g], 0, 0).
    void writePoolDescriptors(uint64_t const* addresses, int64_t* out) const;

    // ---- the kv doctor ----
    void validate() const;  // throws KVInvariantError for the first violation
    void validateStep(StepBatch const& step) const;

    struct Impl;  // plugins/runtime/kv_manager_impl.h

private:
    friend struct ManagerTestAccess;  // the validator's tests corrupt the bookkeeping on purpose
    std::unique_ptr<Impl> impl_;
};

}  // namespace pagedkv::runtime
