// The KV manager's state (private to plugins/runtime: the manager, the step builder, the validator and the
// tests include it). Mirrors the Python manager's: per sequence a committed length, a reservation, known
// tokens and, per pool group, its block list, released pages, prefix-chain position and swapped pages.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "pagedkv/runtime/kv_manager.h"
#include "prefix_cache.h"

namespace pagedkv::runtime {

struct SwappedPage {
    int32_t page;       // index in the block list
    int32_t hostBlock;  // secondary-tier block holding its copy
    int32_t tokens;     // committed tokens copied (page_size: the whole block)
    bool operator==(SwappedPage const& o) const {
        return page == o.page && hostBlock == o.hostBlock && tokens == o.tokens;
    }
};

struct GroupSequence {
    std::vector<int32_t> blocks;       // the block list: pages_needed(L + R) entries, -1 released / swapped
    int32_t releasedHi = 0;            // RELEASE: pages below are released
    int32_t hashedPages = 0;           // prefix reuse: pages [0, hashedPages) have chain nodes ...
    PrefixCache::NodeId lastNode = 0;  // ... the last of which this sequence holds (0: none)
    std::vector<SwappedPage> swapped;  // while swapped out: the host copies of its live pages
    bool operator==(GroupSequence const& o) const {
        return blocks == o.blocks && releasedHi == o.releasedHi && hashedPages == o.hashedPages &&
               lastNode == o.lastNode && swapped == o.swapped;
    }
};

struct Sequence {
    SeqId id = 0;
    uint64_t order = 0;    // insertion order (sequences(), the validator's "first violation")
    int32_t length = 0;    // L: committed tokens
    int32_t reserved = 0;  // R: reserved slots after L
    int32_t promptLen = 0;
    // Token ids known for positions [0, tokens.size()): the prompt, then committed ids. A commit without ids
    // leaves tokens.size() < length for good (Python's token_gap), so no later block is hashed.
    std::vector<int32_t> tokens;
    bool swapped = false;
    std::string salt;  // prefix chain root (e.g. an adapter id)
    std::vector<GroupSequence> groups;
    bool operator==(Sequence const& o) const {
        return id == o.id && order == o.order && length == o.length && reserved == o.reserved &&
               promptLen == o.promptLen && tokens == o.tokens && swapped == o.swapped && salt == o.salt &&
               groups == o.groups;
    }
};

struct KVManager::Impl {
    std::vector<PoolGroup> groups;
    std::vector<BlockAllocator> allocators;      // [G] primary tier
    std::vector<BlockAllocator> hostAllocators;  // [G] secondary tier
    std::vector<PrefixCache> prefix;             // [G], empty without prefix reuse
    std::vector<BlockCopy> copyLog;

    std::vector<Sequence> slots;  // storage; a freed slot is reused (its vectors keep capacity)
    std::vector<int32_t> freeSlots;
    std::unordered_map<SeqId, int32_t> index;  // sequence id -> slot
    uint64_t nextOrder = 0;
    uint64_t version = 0;  // bumped by every change: a StepPlan of an older version is stale

    // scratch of reserve (kept to avoid allocations on the hot path)
    struct GroupPlan {
        int32_t cur = 0, need = 0;
        std::vector<int32_t> cowPages, cowOld, cowKeep, uncache;
    };
    std::vector<GroupPlan> plans;
    std::vector<int32_t> scratchPages, scratchBlocks;

    Sequence& seq(SeqId id);  // throws UnknownSequenceError
    Sequence const& seq(SeqId id) const;
    Sequence& live(SeqId id, char const* what);  // also refuses a swapped-out sequence
    void reserve(Sequence& s, int32_t numTokens);  // KVManager::reserve of a live sequence
    int32_t takeSlot();
    void allocate(int32_t g, int32_t count, SeqId id, std::vector<int32_t>& out);  // evicts cached blocks
    void dropPages(int32_t g, GroupSequence& gs, int32_t start, int32_t stop, bool reverse);
    void releaseWindow(Sequence& s, int32_t g);
    void registerFullPages(Sequence& s, int32_t g);
    int32_t adoptPrefix(Sequence& s);
};

}  // namespace pagedkv::runtime
