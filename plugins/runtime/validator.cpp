// The kv doctor in C++: the invariants of pagedkv.kvcache.validator, in the same order (each check over all
// sequences before the next, sequences in the order they were added), plus the consistency of the exact
// prefix chain (node reference counts) that the Python cache does not have.
#include <algorithm>
#include <unordered_set>

#include "format.h"
#include "kv_manager_impl.h"
#include "window_rules.h"

namespace pagedkv::runtime {

namespace {

using Where = KVInvariantError::Where;

[[noreturn]] void fail(std::string check, std::string detail, Where where, std::string expected, std::string found) {
    throw KVInvariantError(std::move(check), std::move(detail), std::move(where), std::move(expected),
                           std::move(found));
}

template <typename T>
std::string str(T const& v) {
    return cat(v);
}

void checkAllocator(BlockAllocator const& a) {
    char const* tier = tierName(a.tier());
    std::vector<int32_t> forward, backward;
    try {
        forward = a.freeList();
        backward = a.freeListBackwards();
    } catch (BlockRefcountError const& e) {
        fail("free-list", cat(tier, " free list links are corrupt (", e.what(), ")"), {{}, a.name()}, "", "");
    }
    std::vector<int32_t> count(a.numBlocks(), 0);
    for (int32_t b : forward) ++count[b];
    for (int32_t b = 0; b < a.numBlocks(); ++b)
        if (count[b] > 1)
            fail("free-list", cat(tier, " block appears twice in the free list"), {{}, a.name(), {}, b}, "1",
                 str(count[b]));
    if (int32_t(forward.size()) != a.numFree())
        fail("free-list", cat(tier, " free-list length differs from the free count"), {{}, a.name()}, str(a.numFree()),
             str(forward.size()));
    if (!std::equal(forward.rbegin(), forward.rend(), backward.begin(), backward.end()))
        fail("free-list", cat(tier, " free list differs walked backwards"), {{}, a.name()}, "the forward list reversed",
             listRepr(backward));
    for (int32_t b = 0; b < a.numBlocks(); ++b) {
        int32_t rc = a.refcounts()[b];
        if (rc < 0) fail("free-list", cat(tier, " negative refcount"), {{}, a.name(), {}, b}, ">= 0", str(rc));
        if ((rc == 0) != (count[b] == 1))
            fail("free-list",
                 cat(tier, " block is ", rc == 0 ? "free" : "held", " but ", rc == 0 ? "missing from" : "present in",
                     " the free list"),
                 {{}, a.name(), {}, b}, rc == 0 ? "in free list" : "not in free list", cat("refcount ", rc));
    }
}

}  // namespace

void KVManager::validate() const {
    Impl const& m = *impl_;
    size_t const G = m.groups.size();
    for (size_t g = 0; g < G; ++g) {
        checkAllocator(m.allocators[g]);
        checkAllocator(m.hostAllocators[g]);
    }
    std::vector<Sequence const*> seqs;
    std::unordered_set<int32_t> usedSlots;
    for (SeqId id : sequences()) {
        int32_t slot = m.index.at(id);
        if (!usedSlots.insert(slot).second)
            fail("stale-row", "two sequences share a table row", {id}, "unique row", str(slot));
        if (m.slots[slot].id != id)
            fail("stale-row", "a slot holds another sequence", {id}, str(id), str(m.slots[slot].id));
        seqs.push_back(&m.slots[slot]);
    }
    for (Sequence const* s : seqs)
        if (s->length < 0 || s->reserved < 0)
            fail("length-formula", "negative length or reservation", {s->id}, ">= 0",
                 cat("(", s->length, ", ", s->reserved, ")"));
    for (Sequence const* s : seqs)
        if (s->swapped && s->reserved)
            fail("swapped", "a swapped-out sequence holds a reservation", {s->id}, "0", str(s->reserved));

    for (size_t g = 0; g < G; ++g) {
        PoolGroup const& spec = m.groups[g];
        KVLayout const& lay = spec.layout;
        std::string const& name = spec.name;
        int32_t const nb = m.allocators[g].numBlocks();
        for (Sequence const* s : seqs) {
            int32_t expect = lay.pagesNeeded(s->length + s->reserved);
            int32_t n = int32_t(s->groups[g].blocks.size());
            if (n != expect)
                fail("row-extent", "block-list entries differ from pages_needed(length + reserved)", {s->id, name},
                     str(expect), str(n));
        }
        for (Sequence const* s : seqs) {
            auto const& blocks = s->groups[g].blocks;
            for (int32_t j = 0; j < int32_t(blocks.size()); ++j)
                if (blocks[j] < kInvalidBlock || blocks[j] >= nb)
                    fail("block-range", cat("entry outside [-1, ", nb, ")"), {s->id, name, j}, cat("[-1, ", nb, ")"),
                         str(blocks[j]));
        }
        if (spec.mode == WindowMode::kCyclic) {
            for (Sequence const* s : seqs)
                if (int32_t(s->groups[g].blocks.size()) > spec.ringPages)
                    fail("cyclic-range", "a ring sequence holds more pages than sinks + bubble + ring", {s->id, name},
                         str(spec.ringPages), str(s->groups[g].blocks.size()));
            for (Sequence const* s : seqs)
                if (s->reserved > 0 && lay.cyclicLen < int64_t(spec.window) + s->reserved - 1)
                    fail("cyclic-range", "reservation does not fit the ring (cyclic_len >= window + reserved - 1)",
                         {s->id, name}, str(int64_t(spec.window) + s->reserved - 1), str(lay.cyclicLen));
        }
        // the length formula on what the block list actually holds: its extent must give back the slots used
        for (Sequence const* s : seqs) {
            if (s->swapped) continue;
            auto const& blocks = s->groups[g].blocks;
            int32_t extent = int32_t(blocks.size());
            while (extent > 0 && blocks[extent - 1] == kInvalidBlock) --extent;
            int32_t slots = lay.slotsUsed(s->length + s->reserved);
            int32_t found = lengthFromPages(extent, lastPageLen(slots, lay.pageSize), lay.pageSize);
            if (found != slots)
                fail("length-formula",
                     "length_from_pages(held pages, last_page_len) differs from the slots the length uses",
                     {s->id, name}, str(slots), str(found));
        }
        // pages a future query may read hold a block; RELEASE pages out of the window are -1
        for (Sequence const* s : seqs) {
            if (s->swapped) continue;
            PageRange released = releasedPageRange(spec, s->length);
            auto const& blocks = s->groups[g].blocks;
            for (int32_t j = 0; j < int32_t(blocks.size()); ++j)
                if (blocks[j] == kInvalidBlock && !(j >= released.lo && j < released.hi))
                    fail("page-in-live-range", "invalid page inside the live range", {s->id, name, j}, "a block",
                         str(kInvalidBlock));
        }
        for (Sequence const* s : seqs) {
            PageRange released = releasedPageRange(spec, s->length);
            auto const& blocks = s->groups[g].blocks;
            for (int32_t j = released.lo; j < std::min<int32_t>(released.hi, int32_t(blocks.size())); ++j)
                if (blocks[j] != kInvalidBlock)
                    fail("page-in-live-range", "page outside the window was not released", {s->id, name, j, blocks[j]},
                         str(kInvalidBlock), str(blocks[j]));
        }
        // no block written by two live sequences: the pages reserved slots land in are private and uncached
        std::vector<int32_t> pages;
        for (Sequence const* s : seqs) {
            if (s->reserved <= 0) continue;
            writtenPages(spec, s->length, s->reserved, pages);
            for (int32_t j : pages) {
                int32_t b = s->groups[g].blocks[j];
                int32_t rc = b >= 0 ? m.allocators[g].refcount(b) : 0;
                if (rc != 1)
                    fail("shared-write", "reserved slots land in a block other holders read", {s->id, name, j, b}, "1",
                         str(rc));
                if (!m.prefix.empty() && m.prefix[g].isCached(b))
                    fail("shared-write", "reserved slots land in a cached prefix block", {s->id, name, j, b},
                         "not cached", "cached");
            }
        }
        // swapped-out sequences: no device block, one host block per live page
        std::vector<int32_t> hostHolders(m.hostAllocators[g].numBlocks(), 0);
        for (Sequence const* s : seqs) {
            if (!s->swapped) continue;
            GroupSequence const& gs = s->groups[g];
            for (int32_t j = 0; j < int32_t(gs.blocks.size()); ++j)
                if (gs.blocks[j] != kInvalidBlock)
                    fail("swapped", "a swapped-out sequence still holds a device block", {s->id, name, j},
                         str(kInvalidBlock), str(gs.blocks[j]));
            PageRange released = releasedPageRange(spec, s->length);
            std::vector<int32_t> live, swappedPages;
            for (int32_t j = 0; j < int32_t(gs.blocks.size()); ++j)
                if (!(j >= released.lo && j < released.hi)) live.push_back(j);
            for (SwappedPage const& e : gs.swapped) swappedPages.push_back(e.page);
            if (live != swappedPages)
                fail("swapped", "host copies do not cover exactly the live pages", {s->id, name}, listRepr(live),
                     listRepr(swappedPages));
            for (SwappedPage const& e : gs.swapped) {
                if (e.hostBlock < 0 || e.hostBlock >= int32_t(hostHolders.size()))
                    fail("block-range", "host block outside the secondary tier", {s->id, name, {}, e.hostBlock},
                         cat("[0, ", hostHolders.size(), ")"), str(e.hostBlock));
                ++hostHolders[e.hostBlock];
            }
        }
        std::vector<int32_t> holders(nb, 0);
        for (Sequence const* s : seqs)
            for (int32_t b : s->groups[g].blocks)
                if (b >= 0) ++holders[b];
        for (int32_t b = 0; b < nb; ++b) {
            int32_t rc = m.allocators[g].refcounts()[b];
            if (rc != holders[b]) {
                std::optional<SeqId> holder;
                for (Sequence const* s : seqs)
                    if (!holder && std::count(s->groups[g].blocks.begin(), s->groups[g].blocks.end(), b))
                        holder = s->id;
                fail("refcount-holders", "primary refcount differs from the number of block-list entries holding it",
                     {holder, name, {}, b}, str(holders[b]), str(rc));
            }
        }
        for (int32_t b = 0; b < int32_t(hostHolders.size()); ++b) {
            int32_t rc = m.hostAllocators[g].refcounts()[b];
            if (rc != hostHolders[b])
                fail("refcount-holders", "secondary refcount differs from the number of swapped pages holding it",
                     {{}, name, {}, b}, str(hostHolders[b]), str(rc));
        }
        if (!m.prefix.empty()) {
            PrefixCache const& cache = m.prefix[g];
            std::unordered_map<PrefixCache::NodeId, int32_t> refs;  // expected references of each node
            int32_t cached = 0;
            for (auto const& [id, node] : cache.nodes()) {
                if (node.parent) ++refs[node.parent];
                if (node.block >= 0) {
                    ++refs[id];
                    ++cached;
                    if (node.block >= nb)
                        fail("prefix-cache", "cached block id out of range", {{}, name, {}, node.block},
                             cat("[0, ", nb, ")"), str(node.block));
                    if (cache.nodeOf(node.block) != id)
                        fail("prefix-cache", "prefix -> block and block -> prefix maps disagree",
                             {{}, name, {}, node.block}, str(id), str(cache.nodeOf(node.block)));
                }
                if (node.parent && int32_t(node.tokens.size()) != spec.pageSize())
                    fail("prefix-cache", "a cached block is not full", {{}, name, {}, node.block}, str(spec.pageSize()),
                         str(node.tokens.size()));
            }
            for (int32_t b = 0; b < nb; ++b) {
                PrefixCache::NodeId id = cache.nodeOf(b);
                if (id && (!cache.nodes().count(id) || cache.nodes().at(id).block != b))
                    fail("prefix-cache", "block -> prefix entry without its prefix", {{}, name, {}, b}, str(b),
                         cache.nodes().count(id) ? str(cache.nodes().at(id).block) : "no node");
            }
            if (cached != cache.size())
                fail("prefix-cache", "hash and block maps differ in size", {{}, name}, str(cached), str(cache.size()));
            for (Sequence const* s : seqs) {
                GroupSequence const& gs = s->groups[g];
                if ((gs.lastNode != 0) != (gs.hashedPages > 0) || (gs.lastNode && !cache.nodes().count(gs.lastNode)))
                    fail("prefix-cache", "a sequence's last hashed page has no prefix node", {s->id, name},
                         cat(gs.hashedPages, " hashed page(s)"), cat("node ", gs.lastNode));
                if (gs.lastNode) ++refs[gs.lastNode];
            }
            for (auto const& [id, node] : cache.nodes())
                if (node.refs != refs[id])
                    fail("prefix-cache", "prefix node references differ from its children, cache entry and sequences",
                         {{}, name, {}, node.block >= 0 ? std::optional<int64_t>(node.block) : std::nullopt},
                         str(refs[id]), str(node.refs));
        }
        for (int32_t slot : m.freeSlots) {
            GroupSequence const& gs = m.slots[slot].groups[g];
            if (!gs.blocks.empty() || gs.lastNode || !gs.swapped.empty())
                fail("stale-row", "a table row no sequence owns holds block ids", {{}, name}, str(kInvalidBlock),
                     str(slot));
        }
    }
}

void KVManager::validateStep(StepBatch const& step) const {
    Impl const& m = *impl_;
    StepPlan const& p = step.plan;
    int32_t const B = p.numSeqs, T = p.numTokens;
    auto const& cu = step.cuQLens;
    bool monotone = int32_t(cu.size()) == B + 1 && (B == 0 || cu[0] == 0);
    for (int32_t i = 0; monotone && i < B; ++i) monotone = cu[i + 1] >= cu[i];
    if (!monotone)
        fail("indptr-monotone", "cu_q_lens must start at 0 and be non-decreasing", {}, "monotone", listRepr(cu));
    for (int32_t i = 0; i < B; ++i)
        if (step.kvLens[i] != step.pastLens[i] + step.qLens[i])
            fail("pages-vs-kv-len", "kv_lens != past_lens + q_lens", {p.seqIds[i]},
                 str(step.pastLens[i] + step.qLens[i]), str(step.kvLens[i]));
    if (int32_t(step.tokenSeq.size()) != T || int32_t(step.positions.size()) != T || cu[B] != T)
        fail("table-vs-indices", "token arrays differ in length from cu_q_lens", {}, str(T), str(step.tokenSeq.size()));
    for (int32_t i = 0; i < B; ++i)
        for (int32_t t = cu[i]; t < cu[i + 1]; ++t) {
            if (step.tokenSeq[t] != i)
                fail("table-vs-indices", "token_seq disagrees with cu_q_lens", {p.seqIds[i]}, str(i),
                     str(step.tokenSeq[t]));
            if (step.positions[t] != step.pastLens[i] + t - cu[i])
                fail("table-vs-indices", "positions != past_len + index in the sequence", {p.seqIds[i]},
                     str(step.pastLens[i] + t - cu[i]), str(step.positions[t]));
        }
    for (size_t g = 0; g < m.groups.size(); ++g) {
        StepBatch::Group const& gs = step.groups[g];
        KVLayout const& lay = m.groups[g].layout;
        std::string const& name = m.groups[g].name;
        auto const& ptr = gs.kvIndptr;
        bool ok = int32_t(ptr.size()) == B + 1 && ptr[0] == 0 && ptr[B] == int32_t(gs.kvIndices.size());
        for (int32_t i = 0; ok && i < B; ++i) ok = ptr[i + 1] >= ptr[i];
        if (!ok)
            fail("indptr-monotone", "kv_indptr must start at 0, be non-decreasing and end at len(kv_indices)",
                 {{}, name}, cat("0..", gs.kvIndices.size()), listRepr(ptr));
        for (int32_t i = 0; i < B; ++i) {
            int32_t pages = ptr[i + 1] - ptr[i];
            int32_t expect = lay.pagesNeeded(step.kvLens[i]);
            if (pages != expect)
                fail("pages-vs-kv-len", "pages != pages_needed(kv_len)", {p.seqIds[i], name}, str(expect), str(pages));
        }
        for (int32_t i = 0; i < B; ++i) {
            int32_t pages = ptr[i + 1] - ptr[i];
            int32_t slots = lay.slotsUsed(step.kvLens[i]);
            int32_t last = gs.lastPageLens[i];
            int32_t length = lengthFromPages(pages, last, lay.pageSize);
            if (length != slots || last < 1 || last > lay.pageSize)
                fail("length-formula", "length_from_pages(pages, last_page_len) != slots_used(kv_len)",
                     {p.seqIds[i], name}, str(slots), str(length));
        }
        int32_t const MB = p.maxBlocks[g];
        for (int32_t i = 0; i < B; ++i) {
            int32_t const* row = gs.blockTable.data() + int64_t(i) * MB;
            int32_t pages = ptr[i + 1] - ptr[i];
            bool same = std::equal(row, row + pages, gs.kvIndices.begin() + ptr[i]) &&
                        std::all_of(row + pages, row + MB, [](int32_t b) { return b == kInvalidBlock; });
            if (!same)
                fail("table-vs-indices", "block-table row differs from its kv_indices segment (+ -1 padding)",
                     {p.seqIds[i], name},
                     listRepr(std::vector<int32_t>(gs.kvIndices.begin() + ptr[i], gs.kvIndices.begin() + ptr[i + 1])),
                     listRepr(std::vector<int32_t>(row, row + MB)));
        }
        int32_t const nb = m.allocators[g].numBlocks();
        for (int32_t i = 0; i < B; ++i) {
            BlockTableRow row{gs.blockTable.data() + int64_t(i) * MB, MB, nb};
            for (int32_t t = cu[i]; t < cu[i + 1]; ++t) {
                KVLocation loc = locateToken(lay, row, step.positions[t]);
                if (loc.block == kInvalidBlock)
                    fail("token-without-page", cat("new token at position ", step.positions[t], " has no valid page"),
                         {p.seqIds[i], name, loc.pageInSeq}, cat("[0, ", nb, ")"), str(loc.rawEntry));
            }
        }
    }
}

}  // namespace pagedkv::runtime
