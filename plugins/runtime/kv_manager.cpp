// The KV manager's operations (kv_manager.h), step for step the Python manager's
// (src/pagedkv/kvcache/manager.py): the same checks in the same order, the same allocation and release
// order (so the same block ids), the same copy records and the same messages.
#include "pagedkv/runtime/kv_manager.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <unordered_map>

#include "format.h"
#include "kv_manager_impl.h"
#include "pagedkv/step_metadata.h"
#include "window_rules.h"

namespace pagedkv::runtime {

namespace {

constexpr int64_t kInt32Limit = int64_t(std::numeric_limits<int32_t>::max()) + 1;  // 2^31

// One block count per group, each >= 0 (Python's _per_group; an empty host list means no host tier).
std::vector<int64_t> perGroup(std::vector<int64_t> const& values, size_t n, char const* name, bool emptyIsZero) {
    if (values.empty() && emptyIsZero) return std::vector<int64_t>(n, 0);
    if (values.size() != n)
        throw KVArgumentError(cat(name, ": expected one value per pool group (", n, "), got ", values.size()),
                              std::nullopt);
    for (size_t i = 0; i < n; ++i)
        if (values[i] < 0) throw KVArgumentError(cat(name, "[", i, "]: must be >= 0, got ", values[i]), std::nullopt);
    return values;
}

std::string nameList(std::vector<std::string> const& names) {
    std::string out = "[";
    for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + quoted(names[i]);
    return out + "]";
}

}  // namespace

// ---- Impl helpers ------------------------------------------------------------------------------------
Sequence& KVManager::Impl::seq(SeqId id) {
    auto it = index.find(id);
    if (it == index.end()) throw UnknownSequenceError(cat("sequence ", id, " is not in the KV manager"), id);
    return slots[it->second];
}

Sequence const& KVManager::Impl::seq(SeqId id) const { return const_cast<Impl*>(this)->seq(id); }

Sequence& KVManager::Impl::live(SeqId id, char const* what) {
    Sequence& s = seq(id);
    if (s.swapped) throw KVArgumentError(cat(what, ": sequence ", id, " is swapped out; swap_in first"), id);
    return s;
}

int32_t KVManager::Impl::takeSlot() {
    if (freeSlots.empty()) {
        slots.emplace_back();
        slots.back().groups.resize(groups.size());
        return int32_t(slots.size() - 1);
    }
    int32_t slot = freeSlots.back();
    freeSlots.pop_back();
    return slot;
}

void KVManager::Impl::allocate(int32_t g, int32_t count, SeqId id, std::vector<int32_t>& out) {
    out.clear();
    allocators[g].allocate(count, out, id);
    if (!prefix.empty())
        for (int32_t b : out) prefix[g].forget(b);  // handing out a free cached block evicts its prefix entry
}

void KVManager::Impl::dropPages(int32_t g, GroupSequence& gs, int32_t start, int32_t stop, bool reverse) {
    for (int32_t k = 0; k < stop - start; ++k) {
        int32_t j = reverse ? stop - 1 - k : start + k;
        if (gs.blocks[j] >= 0) allocators[g].decref(gs.blocks[j]);
        gs.blocks[j] = kInvalidBlock;
    }
}

void KVManager::Impl::releaseWindow(Sequence& s, int32_t g) {
    PageRange r = releasedPageRange(groups[g], s.length);
    GroupSequence& gs = s.groups[g];
    int32_t start = std::max(r.lo, gs.releasedHi);
    if (r.hi <= start) return;
    for (int32_t j = start; j < r.hi; ++j) {
        int32_t b = gs.blocks[j];
        if (b >= 0) {
            gs.blocks[j] = kInvalidBlock;
            allocators[g].decref(b);
        }
    }
    gs.releasedHi = r.hi;
}

void KVManager::Impl::registerFullPages(Sequence& s, int32_t g) {
    int32_t P = groups[g].pageSize();
    GroupSequence& gs = s.groups[g];
    int32_t full = std::min<int32_t>(s.length, int32_t(s.tokens.size())) / P;  // pages whose tokens are all known
    if (gs.hashedPages >= full) return;
    PrefixCache& cache = prefix[g];
    // `parent` carries one reference of ours: the sequence's on its last node, or a fresh one on the root.
    PrefixCache::NodeId parent = gs.hashedPages ? gs.lastNode : cache.acquireRoot(s.salt);
    for (int32_t j = gs.hashedPages; j < full; ++j) {
        PrefixCache::NodeId node = cache.acquireChild(parent, s.tokens.data() + int64_t(j) * P);
        cache.release(parent);  // the child holds its parent now
        parent = node;
        cache.registerBlock(gs.blocks[j], node);
    }
    gs.lastNode = parent;
    gs.hashedPages = full;
}

int32_t KVManager::Impl::adoptPrefix(Sequence& s) {
    int32_t const n = int32_t(s.tokens.size());
    size_t const G = groups.size();
    std::vector<std::vector<int32_t>> blocks(G);
    std::vector<std::vector<PrefixCache::NodeId>> nodes(G);
    int64_t reused = std::numeric_limits<int64_t>::max();
    for (size_t g = 0; g < G; ++g) {
        int32_t P = groups[g].pageSize();
        PrefixCache const& cache = prefix[g];
        PrefixCache::NodeId node = cache.findRoot(s.salt);
        for (int32_t j = 0; node && j < n / P; ++j) {
            PrefixCache::NodeId child;
            int32_t b = cache.lookup(node, s.tokens.data() + int64_t(j) * P, child);
            if (b < 0) break;
            blocks[g].push_back(b);
            nodes[g].push_back(child);
            node = child;
        }
        reused = std::min<int64_t>(reused, int64_t(blocks[g].size()) * P);
    }
    reused = std::min<int64_t>(reused, std::max(0, n - 1));  // the prompt's last token is always computed
    if (reused == 0) return 0;
    for (size_t g = 0; g < G; ++g) {
        int32_t P = groups[g].pageSize();
        int32_t k = groups[g].layout.pagesNeeded(int32_t(reused));
        GroupSequence& gs = s.groups[g];
        for (int32_t j = 0; j < k; ++j) allocators[g].incref(blocks[g][j]);  // revives a free cached block
        gs.blocks.assign(blocks[g].begin(), blocks[g].begin() + k);
        gs.hashedPages = int32_t(reused / P);
        if (gs.hashedPages) {
            gs.lastNode = nodes[g][gs.hashedPages - 1];
            prefix[g].acquire(gs.lastNode);
        }
    }
    return int32_t(reused);
}

// ---- construction ------------------------------------------------------------------------------------
KVManager::KVManager(std::vector<PoolGroup> groups, std::vector<int64_t> const& numBlocks,
                     std::vector<int64_t> const& hostBlocks, bool enablePrefixReuse)
    : impl_(std::make_unique<Impl>()) {
    Impl& m = *impl_;
    if (groups.empty()) throw KVArgumentError("groups: at least one pool group is needed", std::nullopt);
    std::vector<std::string> names;
    for (auto const& g : groups) names.push_back(g.name);
    for (size_t i = 0; i < names.size(); ++i)
        if (std::count(names.begin(), names.end(), names[i]) > 1)
            throw KVArgumentError(cat("groups: names must be unique, got ", nameList(names)), std::nullopt);
    size_t const G = groups.size();
    std::vector<int64_t> nb = perGroup(numBlocks, G, "num_blocks", false);
    std::vector<int64_t> hb = perGroup(hostBlocks, G, "host_blocks", true);
    for (size_t g = 0; g < G; ++g) {
        if (nb[g] >= kInt32Limit - 1)
            throw KVArgumentError(
                cat("num_blocks: ", nb[g], " for group ", quoted(names[g]), " does not fit the int32 block table"),
                std::nullopt);
        if (hb[g] >= kInt32Limit - 1)
            throw KVArgumentError(
                cat("host_blocks: ", hb[g], " for group ", quoted(names[g]), " does not fit int32 block ids"),
                std::nullopt);
    }
    if (enablePrefixReuse) {
        std::vector<std::string> windowed;
        for (auto const& g : groups)
            if (g.mode != WindowMode::kFull) windowed.push_back(g.name);
        if (!windowed.empty())
            throw KVArgumentError(cat("enable_prefix_reuse: pool group(s) ", nameList(windowed),
                                      " have an attention window; their blocks leave the cache, so a prefix cannot "
                                      "be reused in every group"),
                                  std::nullopt);
    }
    m.groups = std::move(groups);
    for (size_t g = 0; g < G; ++g) {
        m.allocators.emplace_back(int32_t(nb[g]), m.groups[g].name, Tier::kPrimary);
        m.hostAllocators.emplace_back(int32_t(hb[g]), m.groups[g].name, Tier::kSecondary);
        if (enablePrefixReuse) m.prefix.emplace_back(int32_t(nb[g]), m.groups[g].pageSize());
    }
    m.plans.resize(G);
}

KVManager::~KVManager() = default;
KVManager::KVManager(KVManager const& other) : impl_(std::make_unique<Impl>(*other.impl_)) {}
KVManager& KVManager::operator=(KVManager const& other) {
    if (this != &other) impl_ = std::make_unique<Impl>(*other.impl_);
    return *this;
}
KVManager::KVManager(KVManager&&) noexcept = default;
KVManager& KVManager::operator=(KVManager&&) noexcept = default;

bool KVManager::operator==(KVManager const& other) const {
    Impl const& a = *impl_;
    Impl const& b = *other.impl_;
    if (a.groups.size() != b.groups.size() || !(a.allocators == b.allocators) ||
        !(a.hostAllocators == b.hostAllocators) || !(a.prefix == b.prefix) || !(a.copyLog == b.copyLog) ||
        a.index.size() != b.index.size() || a.nextOrder != b.nextOrder)
        return false;
    for (auto const& [id, slot] : a.index) {
        auto it = b.index.find(id);
        if (it == b.index.end() || !(a.slots[slot] == b.slots[it->second])) return false;
    }
    return true;
}

// ---- groups and queries ------------------------------------------------------------------------------
int32_t KVManager::numGroups() const { return int32_t(impl_->groups.size()); }
PoolGroup const& KVManager::group(int32_t g) const { return impl_->groups.at(g); }
bool KVManager::prefixReuse() const { return !impl_->prefix.empty(); }

BlockAllocator const& KVManager::allocator(int32_t g, Tier tier) const {
    return tier == Tier::kPrimary ? impl_->allocators.at(g) : impl_->hostAllocators.at(g);
}

GroupStats KVManager::stats(int32_t g) const {
    Impl const& m = *impl_;
    BlockAllocator const& a = m.allocators.at(g);
    BlockAllocator const& h = m.hostAllocators.at(g);
    return {a.numBlocks(), a.numFree(), h.numBlocks(), h.numFree(), m.prefix.empty() ? 0 : m.prefix[g].size()};
}

std::vector<int32_t> KVManager::cachedBlocks(int32_t g) const {
    return impl_->prefix.empty() ? std::vector<int32_t>{} : impl_->prefix.at(g).cachedBlocks();
}

bool KVManager::contains(SeqId seq) const { return impl_->index.count(seq) != 0; }
int32_t KVManager::numSequences() const { return int32_t(impl_->index.size()); }

std::vector<SeqId> KVManager::sequences() const {
    Impl const& m = *impl_;
    std::vector<std::pair<uint64_t, SeqId>> order;
    for (auto const& [id, slot] : m.index) order.emplace_back(m.slots[slot].order, id);
    std::sort(order.begin(), order.end());
    std::vector<SeqId> out;
    for (auto const& o : order) out.push_back(o.second);
    return out;
}

int32_t KVManager::length(SeqId seq) const { return impl_->seq(seq).length; }
int32_t KVManager::reserved(SeqId seq) const { return impl_->seq(seq).reserved; }
int32_t KVManager::promptLength(SeqId seq) const { return impl_->seq(seq).promptLen; }
int32_t KVManager::prefillRemaining(SeqId seq) const {
    Sequence const& s = impl_->seq(seq);
    return std::max(0, s.promptLen - s.length);
}
bool KVManager::isSwapped(SeqId seq) const { return impl_->seq(seq).swapped; }
std::vector<int32_t> const& KVManager::blockList(SeqId seq, int32_t g) const {
    return impl_->seq(seq).groups.at(g).blocks;
}

std::vector<BlockCopy> const& KVManager::copyLog() const { return impl_->copyLog; }
std::vector<BlockCopy> KVManager::drainCopies() {
    std::vector<BlockCopy> out;
    out.swap(impl_->copyLog);
    return out;
}

// ---- sequences ---------------------------------------------------------------------------------------
int32_t KVManager::addSequence(SeqId id, int32_t const* promptTokens, int32_t promptLen, std::string const& salt) {
    Impl& m = *impl_;
    if (m.index.count(id)) throw KVArgumentError(cat("add_sequence: sequence ", id, " exists already"), id);
    if (promptLen < 0 || (promptLen > 0 && !promptTokens))
        throw KVArgumentError(cat("add_sequence: prompt of ", promptLen, " token(s) at ", promptTokens ? "" : "null ",
                                  "address (sequence ", id, ")"),
                              id);
    int32_t slot = m.takeSlot();
    Sequence& s = m.slots[slot];
    s.id = id;
    s.order = m.nextOrder++;
    s.length = s.reserved = 0;
    s.promptLen = promptLen;
    s.tokens.assign(promptTokens, promptTokens + promptLen);
    s.swapped = false;
    s.salt = salt;
    m.index.emplace(id, slot);
    s.length = m.prefix.empty() ? 0 : m.adoptPrefix(s);
    ++m.version;
    return s.length;
}

void KVManager::reserve(SeqId id, int32_t numTokens) { impl_->reserve(impl_->live(id, "reserve"), numTokens); }

void KVManager::Impl::reserve(Sequence& s, int32_t numTokens) {
    Impl& m = *this;
    SeqId const id = s.id;
    if (numTokens < 0)
        throw KVArgumentError(cat("reserve: num_tokens must be >= 0, got ", numTokens, " (sequence ", id, ")"), id);
    int32_t const L = s.length;
    int32_t const R = std::max(s.reserved, numTokens);
    if (int64_t(L) + R >= kInt32Limit)
        throw KVArgumentError(
            cat("reserve: length ", L, " + ", R, " new tokens overflows int32 positions (sequence ", id, ")"), id);
    size_t const G = m.groups.size();
    for (size_t g = 0; g < G; ++g) {  // plan everything, then check, then act
        PoolGroup const& spec = m.groups[g];
        bool cyclic = spec.mode == WindowMode::kCyclic;
        if (cyclic) checkCyclicStep(spec, R, id);
        GroupSequence const& gs = s.groups[g];
        Impl::GroupPlan& plan = m.plans[g];
        plan.cur = int32_t(gs.blocks.size());
        plan.need = spec.layout.pagesNeeded(L + R);
        plan.cowPages.clear();
        plan.cowOld.clear();
        plan.cowKeep.clear();
        plan.uncache.clear();
        // Pages already held that the new tokens land in. Linear: only page L / P can hold committed tokens
        // (later held pages are this sequence's earlier reservation, private); a ring: any.
        if (cyclic) {
            writtenPages(spec, L, R, m.scratchPages);
        } else {
            m.scratchPages.clear();
            if (R && L / spec.pageSize() < plan.cur) m.scratchPages.push_back(L / spec.pageSize());
        }
        for (int32_t j : m.scratchPages) {
            if (j >= plan.cur) continue;
            int32_t b = gs.blocks[j];
            if (b < 0) throw std::logic_error(cat("internal: written page ", j, " of sequence ", id, " has no block"));
            if (m.allocators[g].refcount(b) > 1) {
                plan.cowPages.push_back(j);
                plan.cowOld.push_back(b);
                plan.cowKeep.push_back(committedTokensInPage(spec, j, L));
            } else if (!m.prefix.empty() && m.prefix[g].isCached(b)) {
                plan.uncache.push_back(b);  // sole holder: leave the cache and write in place
            }
        }
    }
    for (size_t g = 0; g < G; ++g) {
        Impl::GroupPlan const& plan = m.plans[g];
        int32_t fresh = std::max(0, plan.need - plan.cur);
        int32_t count = fresh + int32_t(plan.cowPages.size());
        if (count > m.allocators[g].numFree())
            throw KVCacheExhaustedError(count, m.allocators[g].numFree(), m.groups[g].name, Tier::kPrimary, id,
                                        cat("reserve ", R, " token(s) after ", L, ": ", fresh, " new page(s), ",
                                            plan.cowPages.size(), " copy-on-write"));
    }
    for (size_t g = 0; g < G; ++g) {
        Impl::GroupPlan const& plan = m.plans[g];
        int32_t const P = m.groups[g].pageSize();
        GroupSequence& gs = s.groups[g];
        int32_t const cows = int32_t(plan.cowPages.size());
        m.allocate(int32_t(g), std::max(0, plan.need - plan.cur) + cows, id, m.scratchBlocks);
        for (int32_t i = 0; i < cows; ++i) {
            int32_t keep = plan.cowKeep[i], fresh = m.scratchBlocks[i];
            if (keep > 0)
                m.copyLog.push_back(
                    {int32_t(g), Tier::kPrimary, plan.cowOld[i], Tier::kPrimary, fresh, keep < P ? keep : 0});
            gs.blocks[plan.cowPages[i]] = fresh;
            m.allocators[g].decref(plan.cowOld[i]);
        }
        for (int32_t b : plan.uncache) m.prefix[g].forget(b);
        if (plan.need > plan.cur)
            gs.blocks.insert(gs.blocks.end(), m.scratchBlocks.begin() + cows, m.scratchBlocks.end());
    }
    s.reserved = R;
    ++m.version;
}

void KVManager::reserveMany(SeqId const* seqs, int32_t const* counts, int32_t n) {
    Impl& m = *impl_;
    std::vector<int32_t> slots(n);
    for (int32_t i = 0; i < n; ++i) {  // Python's seq_batch checks: unknown, swapped, repeated
        auto it = m.index.find(seqs[i]);
        if (it == m.index.end())
            throw UnknownSequenceError(cat("reserve_many: sequence ", seqs[i], " is not in the KV manager"), seqs[i]);
        slots[i] = it->second;
    }
    for (int32_t i = 0; i < n; ++i)
        if (m.slots[slots[i]].swapped)
            throw KVArgumentError(cat("reserve_many: sequence ", seqs[i], " is swapped out; swap_in first"), seqs[i]);
    std::vector<int32_t>& seen = m.scratchPages;
    seen.assign(m.slots.size(), 0);
    for (int32_t i = 0; i < n; ++i)
        if (seen[slots[i]]++)
            throw KVArgumentError(
                cat("reserve_many: a sequence appears twice: ", listRepr(std::vector<SeqId>(seqs, seqs + n))), seqs[i]);
    std::vector<int32_t> total(n);
    for (int32_t i = 0; i < n; ++i)
        if (counts[i] < 0)
            throw KVArgumentError(
                cat("reserve_many: num_tokens must be >= 0, got ", counts[i], " (sequence ", seqs[i], ")"), seqs[i]);
    for (int32_t i = 0; i < n; ++i) {
        Sequence const& s = m.slots[slots[i]];
        total[i] = std::max(s.reserved, counts[i]);
        if (int64_t(s.length) + total[i] >= kInt32Limit)
            throw KVArgumentError(cat("reserve_many: length ", s.length, " + ", total[i],
                                      " new tokens overflows int32 positions (sequence ", seqs[i], ")"),
                                  seqs[i]);
    }
    std::unordered_map<int32_t, int32_t> writers;  // block -> how many of the batch write into it
    std::unordered_map<int32_t, int32_t> rank;     // block -> writers seen so far
    for (size_t g = 0; g < m.groups.size(); ++g) {  // plan and check every group, then act
        PoolGroup const& spec = m.groups[g];
        int64_t grow = 0, copies = 0;
        if (spec.mode == WindowMode::kCyclic) {
            for (int32_t i = 0; i < n; ++i) checkCyclicStep(spec, total[i], seqs[i]);
            for (int32_t i = 0; i < n; ++i) {  // every held page a ring step writes may need a copy
                Sequence const& s = m.slots[slots[i]];
                int32_t cur = int32_t(s.groups[g].blocks.size());
                grow += std::max(0, spec.layout.pagesNeeded(s.length + total[i]) - cur);
                writtenPages(spec, s.length, total[i], m.scratchBlocks);
                copies += std::count_if(m.scratchBlocks.begin(), m.scratchBlocks.end(),
                                        [cur](int32_t j) { return j < cur; });
            }
        } else {
            // A linear page L / P held and shared: of the k batch sequences writing one block of refcount c,
            // the first k - 1 copy it, the last one too when c > k (what sequential reserves do).
            auto writtenBlock = [&](int32_t i) -> int32_t {
                Sequence const& s = m.slots[slots[i]];
                auto const& blocks = s.groups[g].blocks;
                int32_t page = s.length / spec.pageSize();
                return total[i] > 0 && page < int32_t(blocks.size()) ? blocks[page] : kInvalidBlock;
            };
            bool shared = false;  // a block of refcount 1 has one holder: only shared blocks can be copied
            for (int32_t i = 0; i < n; ++i) {
                Sequence const& s = m.slots[slots[i]];
                grow += std::max(0, spec.layout.pagesNeeded(s.length + total[i]) - int32_t(s.groups[g].blocks.size()));
                int32_t b = writtenBlock(i);
                shared = shared || (b >= 0 && m.allocators[g].refcount(b) > 1);
            }
            if (shared) {
                writers.clear();
                rank.clear();
                for (int32_t i = 0; i < n; ++i)
                    if (int32_t b = writtenBlock(i); b >= 0) ++writers[b];
                for (int32_t i = 0; i < n; ++i) {
                    int32_t b = writtenBlock(i);
                    if (b < 0) continue;
                    int32_t k = writers[b];
                    copies += rank[b]++ < k - 1 || m.allocators[g].refcount(b) > k;
                }
            }
        }
        int64_t count = grow + copies;
        if (count > m.allocators[g].numFree())
            throw KVCacheExhaustedError(count, m.allocators[g].numFree(), spec.name, Tier::kPrimary, std::nullopt,
                                        cat("reserve_many of ", n, " sequences: ", grow, " new page(s), ", copies,
                                            " copy-on-write"));
    }
    size_t const logged = m.copyLog.size();
    for (int32_t i = 0; i < n; ++i) m.reserve(m.slots[slots[i]], counts[i]);  // fits: the blocks planned above
    bool const ring = std::any_of(m.groups.begin(), m.groups.end(),
                                  [](PoolGroup const& g) { return g.mode == WindowMode::kCyclic; });
    if (!ring)  // Python plans linear groups one after the other: their copies are logged group by group
        std::stable_sort(m.copyLog.begin() + logged, m.copyLog.end(),
                         [](BlockCopy const& a, BlockCopy const& b) { return a.group < b.group; });
}

void KVManager::unreserve(SeqId id) {
    Impl& m = *impl_;
    Sequence& s = m.live(id, "unreserve");
    for (size_t g = 0; g < m.groups.size(); ++g) {
        GroupSequence& gs = s.groups[g];
        int32_t keep = m.groups[g].layout.pagesNeeded(s.length);
        m.dropPages(int32_t(g), gs, keep, int32_t(gs.blocks.size()), false);
        gs.blocks.resize(keep);
    }
    s.reserved = 0;
    ++m.version;
}

void KVManager::commit(SeqId id, int32_t numTokens, int32_t const* tokenIds, int64_t tokenCount) {
    Impl& m = *impl_;
    Sequence& s = m.live(id, "commit");
    int32_t const L = s.length, R = s.reserved;
    if (numTokens < 0 || numTokens > R)
        throw KVArgumentError(cat("commit: sequence ", id, " has ", R, " reserved slot(s), cannot commit ", numTokens),
                              id);
    if (tokenIds) {
        if (tokenCount >= 0 && tokenCount != numTokens)
            throw KVArgumentError(
                cat("commit: token_ids has ", tokenCount, " entries for ", numTokens, " tokens (sequence ", id, ")"),
                id);
        int32_t known = int32_t(s.tokens.size());
        int32_t overlap = std::max(0, std::min(known, L + numTokens) - L);
        if (overlap && std::memcmp(s.tokens.data() + L, tokenIds, sizeof(int32_t) * overlap) != 0)
            throw KVArgumentError(cat("commit: token_ids of sequence ", id,
                                      " differ from its known tokens at positions [", L, ", ", L + overlap, ")"),
                                  id);
        if (known >= L) s.tokens.insert(s.tokens.end(), tokenIds + overlap, tokenIds + numTokens);
    }
    s.length = L + numTokens;
    s.reserved = R - numTokens;
    for (size_t g = 0; g < m.groups.size(); ++g) {
        if (m.groups[g].mode == WindowMode::kRelease) m.releaseWindow(s, int32_t(g));
        if (!m.prefix.empty()) m.registerFullPages(s, int32_t(g));
    }
    ++m.version;
}

void KVManager::free(SeqId id) {
    Impl& m = *impl_;
    Sequence& s = m.seq(id);
    if (s.swapped)
        for (size_t g = 0; g < m.groups.size(); ++g) {
            auto const& entries = s.groups[g].swapped;
            for (auto it = entries.rbegin(); it != entries.rend(); ++it) m.hostAllocators[g].decref(it->hostBlock);
        }
    for (size_t g = 0; g < m.groups.size(); ++g) {
        GroupSequence& gs = s.groups[g];
        // Last pages first: they reach the free list's front and are evicted before the prefix pages.
        m.dropPages(int32_t(g), gs, 0, int32_t(gs.blocks.size()), true);
        if (!m.prefix.empty()) m.prefix[g].release(gs.lastNode);
        gs.blocks.clear();
        gs.swapped.clear();
        gs.releasedHi = gs.hashedPages = 0;
        gs.lastNode = 0;
    }
    s.tokens.clear();
    s.salt.clear();
    s.length = s.reserved = s.promptLen = 0;
    s.swapped = false;
    int32_t slot = m.index.at(id);
    m.index.erase(id);
    m.freeSlots.push_back(slot);
    ++m.version;
}

void KVManager::fork(SeqId srcId, SeqId dstId) {
    Impl& m = *impl_;
    Sequence const& src = m.live(srcId, "fork");
    if (m.index.count(dstId)) throw KVArgumentError(cat("fork: sequence ", dstId, " exists already"), dstId);
    if (src.reserved)
        throw KVArgumentError(cat("fork: sequence ", srcId, " has ", src.reserved,
                                  " reserved slot(s); commit or unreserve before forking (reserved slots are private "
                                  "by definition)"),
                              srcId);
    int32_t srcSlot = m.index.at(srcId);
    int32_t slot = m.takeSlot();  // (may move the slots: index them afterwards)
    Sequence& child = m.slots[slot];
    child = m.slots[srcSlot];
    child.id = dstId;
    child.order = m.nextOrder++;
    child.reserved = 0;
    for (size_t g = 0; g < m.groups.size(); ++g) {
        for (int32_t b : child.groups[g].blocks)
            if (b >= 0) m.allocators[g].incref(b);
        if (!m.prefix.empty()) m.prefix[g].acquire(child.groups[g].lastNode);
    }
    m.index.emplace(dstId, slot);
    ++m.version;
}

void KVManager::swapOut(SeqId id) {
    Impl& m = *impl_;
    Sequence& s = m.live(id, "swap_out");
    if (s.reserved)
        throw KVArgumentError(cat("swap_out: sequence ", id, " has reserved slots; commit or unreserve first"), id);
    size_t const G = m.groups.size();
    for (size_t g = 0; g < G; ++g) {
        auto const& blocks = s.groups[g].blocks;
        int32_t held = int32_t(std::count_if(blocks.begin(), blocks.end(), [](int32_t b) { return b >= 0; }));
        if (held > m.hostAllocators[g].numFree())
            throw KVCacheExhaustedError(held, m.hostAllocators[g].numFree(), m.groups[g].name, Tier::kSecondary, id,
                                        "swap_out");
    }
    int32_t const L = s.length;
    for (size_t g = 0; g < G; ++g) {
        PoolGroup const& spec = m.groups[g];
        GroupSequence& gs = s.groups[g];
        int32_t held = int32_t(std::count_if(gs.blocks.begin(), gs.blocks.end(), [](int32_t b) { return b >= 0; }));
        m.scratchBlocks.clear();
        m.hostAllocators[g].allocate(held, m.scratchBlocks, id, "swap_out");
        gs.swapped.clear();
        for (int32_t j = 0, k = 0; j < int32_t(gs.blocks.size()); ++j) {
            if (gs.blocks[j] < 0) continue;
            int32_t host = m.scratchBlocks[k++];
            int32_t keep = committedTokensInPage(spec, j, L);
            m.copyLog.push_back(
                {int32_t(g), Tier::kPrimary, gs.blocks[j], Tier::kSecondary, host, keep < spec.pageSize() ? keep : 0});
            gs.swapped.push_back({j, host, keep});
        }
        for (int32_t j = int32_t(gs.blocks.size()) - 1; j >= 0; --j) {
            int32_t b = gs.blocks[j];
            if (b < 0) continue;
            gs.blocks[j] = kInvalidBlock;
            m.allocators[g].decref(b);
        }
    }
    s.swapped = true;
    ++m.version;
}

void KVManager::swapIn(SeqId id) {
    Impl& m = *impl_;
    Sequence& s = m.seq(id);
    if (!s.swapped) throw KVArgumentError(cat("swap_in: sequence ", id, " is not swapped out"), id);
    size_t const G = m.groups.size();
    for (size_t g = 0; g < G; ++g) {
        int32_t n = int32_t(s.groups[g].swapped.size());
        if (n > m.allocators[g].numFree())
            throw KVCacheExhaustedError(n, m.allocators[g].numFree(), m.groups[g].name, Tier::kPrimary, id, "swap_in");
    }
    for (size_t g = 0; g < G; ++g) {
        PoolGroup const& spec = m.groups[g];
        GroupSequence& gs = s.groups[g];
        m.allocate(int32_t(g), int32_t(gs.swapped.size()), id, m.scratchBlocks);
        for (size_t i = 0; i < gs.swapped.size(); ++i) {
            SwappedPage const& e = gs.swapped[i];
            int32_t b = m.scratchBlocks[i];
            m.copyLog.push_back({int32_t(g), Tier::kSecondary, e.hostBlock, Tier::kPrimary, b,
                                 e.tokens < spec.pageSize() ? e.tokens : 0});
            gs.blocks[e.page] = b;
            m.hostAllocators[g].decref(e.hostBlock);
        }
        gs.swapped.clear();
    }
    s.swapped = false;
    ++m.version;
}

void KVManager::writePoolDescriptors(uint64_t const* addresses, int64_t* out) const {
    Impl const& m = *impl_;
    for (size_t g = 0; g < m.groups.size(); ++g) {
        int64_t* row = out + g * kPoolDescFields;
        std::fill(row, row + kPoolDescFields, int64_t(0));
        row[kPoolDescAddress] = int64_t(addresses[g]);
        row[kPoolDescNumBlocks] = m.allocators[g].numBlocks();
    }
}

}  // namespace pagedkv::runtime
