// Prefix reuse: full blocks of one pool group identified by their whole prefix (the twin of
// pagedkv.kvcache.prefix.PrefixCache, same observable behaviour).
//
// Python names a full block by a BLAKE2b digest chained from a salt over the block's tokens and compares
// the tokens on a hit. Here the chain is exact instead of hashed: a node is (parent node, the block's
// tokens), a root node is a salt, and each node id stands for one whole prefix (salt + every token up to
// the block's end) for as long as the node lives. The hash below only picks buckets; a hit always compares
// the parent id and every token, so no collision can hand out wrong KV.
//
// Nodes are reference counted: by their children (a live node's ancestors live, so ids stay the names of
// their prefixes), by the cache entry registered under them, and by sequences (the last hashed page of each
// sequence: the parent of its next full block). A node nobody holds is erased.
//
// The cache: node -> block and block -> node. Only full blocks are registered, the first copy of a prefix
// stays (registering a second block under a cached node is refused), and handing out a free cached block
// evicts its entry (the manager calls forget).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace pagedkv::runtime {

class PrefixCache {
public:
    using NodeId = int64_t;  // 0: no node
    struct Node {
        NodeId parent = 0;            // 0 for a root
        std::vector<int32_t> tokens;  // the block's tokens [page_size] (empty for a root)
        std::string salt;             // roots only
        uint64_t hash = 0;
        int32_t refs = 0;
        int32_t block = -1;  // the block registered under this prefix, or -1
        bool operator==(Node const& o) const {
            return parent == o.parent && tokens == o.tokens && salt == o.salt && hash == o.hash && refs == o.refs &&
                   block == o.block;
        }
    };

    PrefixCache(int32_t numBlocks, int32_t pageSize);

    // ---- the chain (each acquire gives the caller one reference; release gives it back) ----
    NodeId findRoot(std::string const& salt) const;
    NodeId findChild(NodeId parent, int32_t const* tokens) const;  // tokens: [page_size]
    NodeId acquireRoot(std::string const& salt);
    NodeId acquireChild(NodeId parent, int32_t const* tokens);
    void acquire(NodeId node);
    void release(NodeId node);

    // ---- the cache ----
    // The block cached for (parent, tokens), or -1.
    int32_t lookup(NodeId parent, int32_t const* tokens, NodeId& child) const;
    bool registerBlock(int32_t block, NodeId node);  // false when the prefix or the block is cached already
    bool forget(int32_t block);
    bool isCached(int32_t block) const { return blockNode_[block] != 0; }
    NodeId nodeOf(int32_t block) const { return blockNode_[block]; }
    int32_t size() const { return numCached_; }
    std::vector<int32_t> cachedBlocks() const;  // ascending

    int32_t pageSize() const { return pageSize_; }
    std::unordered_map<NodeId, Node> const& nodes() const { return nodes_; }
    bool operator==(PrefixCache const& other) const;

private:
    uint64_t childHash(NodeId parent, int32_t const* tokens) const;
    static uint64_t rootHash(std::string const& salt);
    NodeId insert(Node node);

    int32_t pageSize_;
    std::unordered_map<NodeId, Node> nodes_;
    std::unordered_multimap<uint64_t, NodeId> byHash_;
    std::vector<NodeId> blockNode_;  // [num_blocks] the node a block is registered under, or 0
    int32_t numCached_ = 0;
    NodeId nextId_ = 1;
};

}  // namespace pagedkv::runtime
