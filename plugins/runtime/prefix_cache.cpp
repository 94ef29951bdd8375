// Exact chained prefix keys and the block cache (prefix_cache.h).
#include "prefix_cache.h"

#include <algorithm>
#include <cstring>

namespace pagedkv::runtime {

namespace {

// Bucket hash only (a hit compares everything): splitmix64's finaliser over 64-bit words.
uint64_t mix(uint64_t h, uint64_t word) {
    h ^= word + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebull;
    return h ^ (h >> 31);
}

}  // namespace

PrefixCache::PrefixCache(int32_t numBlocks, int32_t pageSize) : pageSize_(pageSize), blockNode_(numBlocks, 0) {}

uint64_t PrefixCache::childHash(NodeId parent, int32_t const* tokens) const {
    uint64_t h = mix(0x70616765646b76ull, uint64_t(parent));
    for (int32_t i = 0; i < pageSize_; ++i) h = mix(h, uint32_t(tokens[i]));
    return h;
}

uint64_t PrefixCache::rootHash(std::string const& salt) {
    uint64_t h = mix(0x73616c74ull, salt.size());
    for (unsigned char c : salt) h = mix(h, c);
    return h;
}

PrefixCache::NodeId PrefixCache::findRoot(std::string const& salt) const {
    auto range = byHash_.equal_range(rootHash(salt));
    for (auto it = range.first; it != range.second; ++it) {
        Node const& n = nodes_.at(it->second);
        if (n.parent == 0 && n.tokens.empty() && n.salt == salt) return it->second;
    }
    return 0;
}

PrefixCache::NodeId PrefixCache::findChild(NodeId parent, int32_t const* tokens) const {
    auto range = byHash_.equal_range(childHash(parent, tokens));
    for (auto it = range.first; it != range.second; ++it) {
        Node const& n = nodes_.at(it->second);
        if (n.parent == parent && int32_t(n.tokens.size()) == pageSize_ &&
            std::memcmp(n.tokens.data(), tokens, sizeof(int32_t) * pageSize_) == 0)
            return it->second;
    }
    return 0;
}

PrefixCache::NodeId PrefixCache::insert(Node node) {
    NodeId id = nextId_++;
    byHash_.emplace(node.hash, id);
    node.refs = 1;
    nodes_.emplace(id, std::move(node));
    return id;
}

PrefixCache::NodeId PrefixCache::acquireRoot(std::string const& salt) {
    if (NodeId id = findRoot(salt)) {
        ++nodes_.at(id).refs;
        return id;
    }
    Node n;
    n.salt = salt;
    n.hash = rootHash(salt);
    return insert(std::move(n));
}

PrefixCache::NodeId PrefixCache::acquireChild(NodeId parent, int32_t const* tokens) {
    if (NodeId id = findChild(parent, tokens)) {
        ++nodes_.at(id).refs;
        return id;
    }
    Node n;
    n.parent = parent;
    n.tokens.assign(tokens, tokens + pageSize_);
    n.hash = childHash(parent, tokens);
    ++nodes_.at(parent).refs;  // a child keeps its prefix alive
    return insert(std::move(n));
}

void PrefixCache::acquire(NodeId node) {
    if (node) ++nodes_.at(node).refs;
}

void PrefixCache::release(NodeId node) {
    while (node) {  // erasing a node releases its parent: a loop, not a recursion (chains are long)
        auto it = nodes_.find(node);
        Node& n = it->second;
        if (--n.refs > 0) return;
        auto range = byHash_.equal_range(n.hash);
        for (auto h = range.first; h != range.second; ++h) {
            if (h->second == node) {
                byHash_.erase(h);
                break;
            }
        }
        NodeId parent = n.parent;
        nodes_.erase(it);
        node = parent;
    }
}

int32_t PrefixCache::lookup(NodeId parent, int32_t const* tokens, NodeId& child) const {
    child = findChild(parent, tokens);
    return child ? nodes_.at(child).block : -1;
}

bool PrefixCache::registerBlock(int32_t block, NodeId node) {
    Node& n = nodes_.at(node);
    if (n.block >= 0 || blockNode_[block] != 0) return false;
    n.block = block;
    ++n.refs;
    blockNode_[block] = node;
    ++numCached_;
    return true;
}

bool PrefixCache::forget(int32_t block) {
    NodeId node = blockNode_[block];
    if (!node) return false;
    blockNode_[block] = 0;
    nodes_.at(node).block = -1;
    --numCached_;
    release(node);
    return true;
}

std::vector<int32_t> PrefixCache::cachedBlocks() const {
    std::vector<int32_t> out;
    for (int32_t b = 0; b < int32_t(blockNode_.size()); ++b)
        if (blockNode_[b]) out.push_back(b);
    return out;
}

bool PrefixCache::operator==(PrefixCache const& o) const {
    return pageSize_ == o.pageSize_ && nodes_ == o.nodes_ && blockNode_ == o.blockNode_ && numCached_ == o.numCached_ &&
           nextId_ == o.nextId_;
}

}  // namespace pagedkv::runtime
