// Unit tests of the C++ KV manager: allocator order, spec checks, chunked prefill, prefix reuse (partial-page
// copy-on-write, in-place write by a sole holder, salts, eviction), fork/COW, released and cyclic windows,
// swap, all-or-nothing exhaustion, the step-metadata arrays against hand-computed values, the doctor against
// hand-made corruptions. Contents are read back through block lists from the tests' token pools.
#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "check.h"
#include "kv_manager_impl.h"
#include "pagedkv/step_metadata.h"
#include "pool_groups.h"
#include "token_pools.h"

namespace pagedkv::runtime {

// The doctor's tests corrupt the bookkeeping by hand.
struct ManagerTestAccess {
    static KVManager::Impl& impl(KVManager& m) { return *m.impl_; }
};
struct AllocatorTestAccess {
    static std::vector<int32_t>& refcounts(BlockAllocator& a) { return a.refcount_; }
    static std::vector<int32_t>& next(BlockAllocator& a) { return a.next_; }
};

namespace check {
namespace {

using Blocks = std::vector<int32_t>;

PoolGroup spec(std::string name, int32_t layers, int32_t heads, int32_t page, int32_t dim,
                   PageLayout pageLayout = PageLayout::kHND, int32_t window = 0, int32_t attentionSinks = 0,
                   int32_t ringSinkTokens = 0, int32_t cyclicLen = 0) {
    return makePoolGroup(groupParams(std::move(name), layers, heads, page, dim, pageLayout, window, attentionSinks,
                                         ringSinkTokens, cyclicLen));
}

std::vector<int32_t> range(int32_t lo, int32_t hi) {  // [lo, hi)
    std::vector<int32_t> v(hi - lo);
    std::iota(v.begin(), v.end(), lo);
    return v;
}

std::string messageOf(std::function<void()> const& body) {
    try {
        body();
    } catch (std::exception const& e) {
        return e.what();
    }
    return "(no exception)";
}

// One engine step: reserve, build, copies, write, commit. entries: (sequence, its new token ids).
StepBatch run(KVManager& m, TokenPools& pools, std::vector<std::pair<SeqId, std::vector<int32_t>>> const& entries) {
    std::vector<StepEntry> step;
    std::vector<std::vector<int32_t>> tokens;
    for (auto const& [id, toks] : entries) {
        m.reserve(id, int32_t(toks.size()));
        step.push_back({id, int32_t(toks.size())});
        tokens.push_back(toks);
    }
    StepBatch batch;
    m.buildStep(step.data(), int32_t(step.size()), batch);
    m.validateStep(batch);
    pools.applyCopies(m.drainCopies());
    pools.writeStep(m, batch, tokens);
    for (auto const& [id, toks] : entries) m.commit(id, int32_t(toks.size()), toks.data());
    m.validate();
    return batch;
}

// Every position of `seq` in [lo, hi) reads back tokens[pos] in group g.
bool reads(KVManager const& m, TokenPools const& pools, SeqId seq, int32_t g, std::vector<int32_t> const& tokens,
           int32_t lo = 0) {
    for (int32_t pos = lo; pos < int32_t(tokens.size()); ++pos)
        if (pools.read(g, m.blockList(seq, g), pos) != tokens[pos]) return false;
    return true;
}

}  // namespace

PKV_TEST(allocator_hands_out_oldest_freed_first_and_revives_from_the_middle) {
    BlockAllocator a(5, "g", Tier::kPrimary);
    Blocks got;
    a.allocate(3, got);
    EXPECT_EQ(got, (Blocks{0, 1, 2}));
    EXPECT(a.decref(2));  // became free
    a.decref(1);
    a.decref(0);
    EXPECT_EQ(a.freeList(), (Blocks{3, 4, 2, 1, 0}));
    Blocks back = a.freeListBackwards();
    EXPECT(std::equal(back.rbegin(), back.rend(), a.freeList().begin()));
    a.incref(1);  // a free cached block leaves the list from the middle
    EXPECT_EQ(a.freeList(), (Blocks{3, 4, 2, 0}));
    EXPECT_EQ(a.refcount(1), 1);
    a.incref(1);
    EXPECT(!a.decref(1));
    BlockAllocator before = a;
    EXPECT_THROW_THEN(a.allocate(5, got, SeqId(7), "x"), KVCacheExhaustedError, {
        EXPECT_EQ(e.needed, 5);
        EXPECT_EQ(e.free, 4);
        EXPECT(e.seq && *e.seq == 7);
        EXPECT_EQ(std::string(e.what()),
                  std::string("KV cache exhausted: sequence 7 needs 5 block(s) in pool group 'g' "
                              "(primary tier) (x) but only 4 are free; nothing was changed"));
    });
    EXPECT(a == before);
    EXPECT_THROW_THEN(a.decref(0), BlockRefcountError, {
        EXPECT(std::string(e.what()).find("double free") != std::string::npos);
        EXPECT_EQ(e.block, 0);
    });
    BlockAllocator empty(0, "e", Tier::kSecondary);
    EXPECT(empty.freeList().empty());
    empty.allocate(0, got);
    EXPECT_THROW(empty.allocate(1, got), KVCacheExhaustedError);
}

PoolGroupParams params(int32_t page, int32_t window, int32_t attentionSinks, int32_t ringSinkTokens, int32_t cyclicLen) {
    return groupParams("g", 1, 1, page, 1, PageLayout::kHND, window, attentionSinks, ringSinkTokens, cyclicLen);
}

PKV_TEST(pool_group_specs_are_checked_like_the_python_spec) {
    auto message = [](PoolGroupParams const& p) { return messageOf([&] { makePoolGroup(p); }); };
    EXPECT_EQ(message(params(0, 0, 0, 0, 0)), std::string("page_size: must be > 0, got 0"));
    EXPECT_EQ(message(params(4, 0, 0, 0, 6)),
              std::string("cyclic_len: must be 0 or a positive multiple of page_size=4, got 6"));
    EXPECT_EQ(message(params(4, -1, 0, 0, 0)),
              std::string("window: must be >= 0 (0: full causal), got -1 (group 'g')"));
    EXPECT_EQ(message(params(4, 0, 2, 0, 0)),
              std::string("attention_sinks=2: only meaningful with a window > 0 (group 'g')"));
    EXPECT_EQ(
        message(params(4, 0, 0, 0, 8)),
        std::string("window: a cyclic pool group (cyclic_len=8) needs the attention window > 0, got 0 (group 'g')"));
    EXPECT_EQ(message(params(4, 9, 0, 0, 8)),
              std::string("cyclic_len=8 < window=9: the ring must hold the window (group 'g')"));
    EXPECT_EQ(message(params(4, 5, 1, 2, 8)),
              std::string("attention_sinks=1 must equal the layout's ring_sink_tokens=2: sink positions outside the ring's "
                          "sinks would be overwritten (group 'g')"));
    PoolGroup ring = makePoolGroup(params(4, 5, 2, 2, 8));  // sinks 2, bubble 2, ring 8: 3 pages
    EXPECT(ring.mode == WindowMode::kCyclic);
    EXPECT_EQ(ring.ringPages, 3);
    EXPECT(makePoolGroup(params(4, 5, 2, 0, 0)).mode == WindowMode::kRelease);
    EXPECT(makePoolGroup(params(4, 0, 0, 0, 0)).mode == WindowMode::kFull);
    EXPECT_EQ(messageOf([] { KVManager({spec("a", 1, 1, 4, 1), spec("a", 1, 1, 4, 1)}, {4, 4}); }),
              std::string("groups: names must be unique, got ['a', 'a']"));
    EXPECT_EQ(messageOf([] { KVManager({spec("w", 1, 1, 4, 1, PageLayout::kHND, 5)}, {4}, {}, true); }),
              std::string("enable_prefix_reuse: pool group(s) ['w'] have an attention window; their blocks leave the "
                          "cache, so a prefix cannot be reused in every group"));
    EXPECT_EQ(messageOf([] { KVManager({spec("a", 1, 1, 4, 1)}, {int64_t(1) << 31}); }),
              std::string("num_blocks: 2147483648 for group 'a' does not fit the int32 block table"));
    EXPECT_EQ(quoted("it's"), std::string("\"it's\""));
}

PKV_TEST(chunked_prefill_past_lengths_and_contents) {
    KVManager m({spec("full", 2, 2, 4, 3)}, {16});
    TokenPools pools(m);
    std::vector<int32_t> prompt = range(1, 12);  // 11 tokens, chunks of 4: past lengths 0, 4, 8
    EXPECT_EQ(m.addSequence(1, prompt.data(), 11), 0);
    std::vector<int32_t> pasts;
    while (m.prefillRemaining(1)) {
        int32_t L = m.length(1), n = std::min(4, m.prefillRemaining(1));
        StepBatch step = run(m, pools, {{1, std::vector<int32_t>(prompt.begin() + L, prompt.begin() + L + n)}});
        pasts.push_back(step.pastLens[0]);
    }
    EXPECT_EQ(pasts, (std::vector<int32_t>{0, 4, 8}));
    EXPECT_EQ(m.length(1), 11);
    EXPECT_EQ(m.blockList(1, 0), (Blocks{0, 1, 2}));
    run(m, pools, {{1, {50}}});  // decode: position 11 lands at offset 3 of page 2
    prompt.push_back(50);
    EXPECT(reads(m, pools, 1, 0, prompt));
    EXPECT_EQ(m.stats(0).numFree, 13);
    m.free(1);
    EXPECT_EQ(m.stats(0).numFree, 16);
    EXPECT(!m.contains(1));
    EXPECT_EQ(m.allocator(0).freeList(), (Blocks{3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 1, 0}));
}

PKV_TEST(prefix_reuse_shares_full_blocks_and_copies_a_partly_reused_page) {
    KVManager m({spec("full", 1, 1, 4, 2)}, {16}, {}, true);
    TokenPools pools(m);
    std::vector<int32_t> a = range(1, 11);  // 10 tokens: pages 0 and 1 full, page 2 holds 2
    m.addSequence(1, a.data(), 10);
    run(m, pools, {{1, a}});
    EXPECT_EQ(m.cachedBlocks(0), (Blocks{0, 1}));
    std::vector<int32_t> b = range(1, 9);
    b.insert(b.end(), {20, 21});
    EXPECT_EQ(m.addSequence(2, b.data(), 10), 8);  // two full pages shared
    EXPECT_EQ(m.blockList(2, 0), (Blocks{0, 1}));
    EXPECT_EQ(m.allocator(0).refcount(1), 2);
    run(m, pools, {{2, {20, 21}}});
    EXPECT(reads(m, pools, 2, 0, b));
    std::vector<int32_t> c = range(1, 9);  // exactly the two cached pages: the last token is recomputed
    EXPECT_EQ(m.addSequence(3, c.data(), 8), 7);
    EXPECT_EQ(m.blockList(3, 0), (Blocks{0, 1}));
    m.reserve(3, 1);  // position 7 lands in shared page 1: a private copy of its first 3 tokens
    EXPECT_EQ(m.blockList(3, 0), (Blocks{0, 4}));
    EXPECT(m.copyLog() == (std::vector<BlockCopy>{{0, Tier::kPrimary, 1, Tier::kPrimary, 4, 3}}));
    m.unreserve(3);
    run(m, pools, {{3, {8}}});
    EXPECT(reads(m, pools, 3, 0, c));
    EXPECT(reads(m, pools, 1, 0, a));              // the original page is untouched
    EXPECT_EQ(m.cachedBlocks(0), (Blocks{0, 1}));  // the first copy of a prefix stays
    std::string salt = "adapter";
    EXPECT_EQ(m.addSequence(4, a.data(), 10, salt), 0);  // another salt: another chain
    for (SeqId s : {1, 2, 3, 4}) m.free(s);
    EXPECT_EQ(m.stats(0).numFree, 16);
    EXPECT_EQ(m.stats(0).numCached, 2);  // free but still cached ...
    m.addSequence(5, nullptr, 0);
    m.reserve(5, 64);  // ... until the allocator hands them out
    EXPECT_EQ(m.stats(0).numCached, 0);
    m.validate();
}

PKV_TEST(a_sole_holder_writes_a_cached_block_in_place) {
    KVManager m({spec("full", 1, 1, 4, 2)}, {8}, {}, true);
    TokenPools pools(m);
    std::vector<int32_t> a = range(1, 9);
    m.addSequence(1, a.data(), 8);
    run(m, pools, {{1, a}});
    m.free(1);  // blocks 0 and 1 stay cached in the free list
    EXPECT_EQ(m.addSequence(2, a.data(), 8), 7);
    EXPECT_EQ(m.allocator(0).refcount(1), 1);
    m.reserve(2, 1);  // page 1 has no other holder: it leaves the cache and is written in place
    EXPECT(m.copyLog().empty());
    EXPECT_EQ(m.blockList(2, 0), (Blocks{0, 1}));
    EXPECT_EQ(m.cachedBlocks(0), (Blocks{0}));
    m.validate();
}

PKV_TEST(fork_shares_blocks_and_copies_on_first_write) {
    KVManager m({spec("full", 1, 2, 4, 1, PageLayout::kNHD)}, {8});
    TokenPools pools(m);
    std::vector<int32_t> a = range(1, 7);
    m.addSequence(1, a.data(), 6);
    run(m, pools, {{1, a}});
    m.fork(1, 2);
    EXPECT_EQ(m.blockList(2, 0), (Blocks{0, 1}));
    EXPECT_EQ(m.allocator(0).refcount(1), 2);
    run(m, pools, {{1, {7, 8}}});  // the shared partial page 1: a copy of its 2 committed tokens
    EXPECT_EQ(m.blockList(1, 0), (Blocks{0, 2}));
    run(m, pools, {{2, {30, 31}}});  // now the only holder of block 1: in place
    EXPECT_EQ(m.blockList(2, 0), (Blocks{0, 1}));
    EXPECT(reads(m, pools, 1, 0, {1, 2, 3, 4, 5, 6, 7, 8}));
    EXPECT(reads(m, pools, 2, 0, {1, 2, 3, 4, 5, 6, 30, 31}));
    m.reserve(1, 1);
    EXPECT_EQ(messageOf([&] { m.fork(1, 3); }),
              std::string("fork: sequence 1 has 1 reserved slot(s); commit or unreserve before forking (reserved slots "
                          "are private by definition)"));
    EXPECT_EQ(messageOf([&] { m.fork(2, 1); }), std::string("fork: sequence 1 exists already"));
}

PKV_TEST(released_window_returns_pages_and_leaves_holes) {
    // window 5, sinks 2, page 3 (the divmod path): after a commit at L, pages inside [S, L - W + 1) go
    KVManager m({spec("win", 2, 1, 3, 1, PageLayout::kNHD, 5, 2)}, {20});
    TokenPools pools(m);
    std::vector<int32_t> prompt = range(1, 16);
    m.addSequence(1, prompt.data(), 15);
    for (int32_t L = 0; L < 15; L += 3)
        run(m, pools, {{1, std::vector<int32_t>(prompt.begin() + L, prompt.begin() + L + 3)}});
    EXPECT_EQ(m.blockList(1, 0), (Blocks{0, -1, -1, 3, 4}));
    EXPECT_EQ(m.stats(0).numFree, 17);
    m.reserve(1, 1);
    StepEntry e{1, -1};
    StepBatch step;
    m.buildStep(&e, 1, step);
    EXPECT_EQ(step.groups[0].kvIndices, (Blocks{0, -1, -1, 3, 4, 5}));  // released blocks 1, 2 went to the tail
    EXPECT_EQ(step.groups[0].lastPageLens, (Blocks{1}));
    // the sinks and the last W - 1 positions read back
    for (int32_t pos : {0, 1, 11, 12, 13, 14}) EXPECT_EQ(pools.read(0, m.blockList(1, 0), pos), prompt[pos]);
}

PKV_TEST(cyclic_ring_keeps_its_pages_and_refuses_a_step_longer_than_the_ring_allows) {
    // sinks 2 + bubble 2 + ring 8 = 3 pages of 4; window 5
    KVManager m({spec("ring", 1, 1, 4, 2, PageLayout::kHND, 5, 2, 2, 8)}, {8});
    TokenPools pools(m);
    std::vector<int32_t> tokens = {1, 2, 3};
    m.addSequence(1, tokens.data(), 3);
    run(m, pools, {{1, tokens}});
    for (int32_t t = 4; t <= 24; ++t) {
        run(m, pools, {{1, {t}}});
        tokens.push_back(t);
        EXPECT(m.blockList(1, 0).size() <= 3);
    }
    EXPECT_EQ(m.stats(0).numFree, 5);
    for (int32_t pos : {0, 1}) EXPECT_EQ(pools.read(0, m.blockList(1, 0), pos), tokens[pos]);
    EXPECT(reads(m, pools, 1, 0, tokens, 24 - 8));  // the ring's last 8 positions
    EXPECT_EQ(messageOf([&] { m.reserve(1, 5); }),
              std::string("sequence 1: cyclic_len=8 of pool group 'ring' is too short for a step of 5 new tokens with "
                          "window=5: the ring needs cyclic_len >= window + new_tokens - 1 = 9"));
    m.fork(1, 2);
    m.reserve(2, 1);  // a ring page is copied whole
    EXPECT_EQ(m.copyLog().size(), size_t(1));
    EXPECT_EQ(m.copyLog()[0].numTokens, 0);
    m.validate();
}

PKV_TEST(swap_out_and_in_copy_committed_tokens_and_are_all_or_nothing) {
    KVManager m({spec("full", 1, 1, 4, 2)}, {8}, {4});
    TokenPools pools(m);
    std::vector<int32_t> a = range(1, 7);
    m.addSequence(1, a.data(), 6);
    run(m, pools, {{1, a}});
    m.swapOut(1);
    EXPECT(m.copyLog() == (std::vector<BlockCopy>{{0, Tier::kPrimary, 0, Tier::kSecondary, 0, 0},
                                                  {0, Tier::kPrimary, 1, Tier::kSecondary, 1, 2}}));
    EXPECT_EQ(m.blockList(1, 0), (Blocks{-1, -1}));
    EXPECT_EQ(m.stats(0).numFree, 8);
    StepEntry e{1, -1};
    StepBatch step;
    EXPECT_EQ(messageOf([&] { m.buildStep(&e, 1, step); }),
              std::string("build_step: sequence 1 is swapped out; swap_in first"));
    EXPECT_EQ(messageOf([&] { m.reserve(1, 1); }), std::string("reserve: sequence 1 is swapped out; swap_in first"));
    pools.applyCopies(m.drainCopies());
    m.addSequence(2, nullptr, 0);
    m.reserve(2, 8);  // blocks 2, 3 of the free list first: the swapped-in pages get other blocks
    m.swapIn(1);
    pools.applyCopies(m.drainCopies());
    EXPECT(reads(m, pools, 1, 0, a));
    m.free(2);
    KVManager small({spec("full", 1, 1, 4, 2)}, {8}, {1});
    small.addSequence(1, a.data(), 6);
    small.reserve(1, 6);
    small.commit(1, 6);
    KVManager before = small;
    EXPECT_THROW_THEN(small.swapOut(1), KVCacheExhaustedError, {
        EXPECT(e.tier == Tier::kSecondary);
        EXPECT_EQ(e.needed, 2);
    });
    EXPECT(small == before);
}

PKV_TEST(exhaustion_names_the_group_and_changes_nothing) {
    KVManager m({spec("big", 1, 1, 4, 1), spec("small", 1, 1, 2, 1)}, {16, 3});
    m.addSequence(1, nullptr, 0);
    m.reserve(1, 4);
    KVManager before = m;
    EXPECT_THROW_THEN(m.reserve(1, 8), KVCacheExhaustedError, {
        EXPECT_EQ(e.group, std::string("small"));
        EXPECT_EQ(e.needed, 2);
        EXPECT_EQ(e.free, 1);
        EXPECT(e.seq && *e.seq == 1);
        EXPECT_EQ(e.operation, std::string("reserve 8 token(s) after 0: 2 new page(s), 0 copy-on-write"));
    });
    EXPECT(m == before);
}

PKV_TEST(step_arrays_match_hand_computed_values) {
    KVManager m({spec("p4", 1, 1, 4, 1), spec("p3", 1, 2, 3, 1, PageLayout::kNHD)}, {16, 16});
    std::vector<int32_t> none;
    m.addSequence(10, nullptr, 0);
    m.addSequence(20, nullptr, 0);
    m.reserve(20, 6);
    m.commit(20, 6);
    m.reserve(20, 3);  // the step uses 1 of 3: the extra page stays hidden
    m.reserve(10, 5);
    std::vector<StepEntry> entries = {{10, -1}, {20, 1}};
    StepBatch s;
    m.buildStep(entries.data(), 2, s);
    EXPECT_EQ(s.cuQLens, (Blocks{0, 5, 6}));
    EXPECT_EQ(s.pastLens, (Blocks{0, 6}));
    EXPECT_EQ(s.qLens, (Blocks{5, 1}));
    EXPECT_EQ(s.kvLens, (Blocks{5, 7}));
    EXPECT_EQ(s.tokenSeq, (Blocks{0, 0, 0, 0, 0, 1}));
    EXPECT_EQ(s.positions, (Blocks{0, 1, 2, 3, 4, 6}));
    EXPECT_EQ(s.plan.maxQLen, 5);
    EXPECT_EQ(s.plan.maxKVLen, 7);
    for (int32_t g = 0; g < 2; ++g) {
        int32_t P = g == 0 ? 4 : 3;
        Blocks a = m.blockList(10, g), b = m.blockList(20, g);
        int32_t pa = (5 + P - 1) / P, pb = (7 + P - 1) / P, mb = std::max(pa, pb);
        EXPECT_EQ(int32_t(b.size()), (9 + P - 1) / P);
        Blocks table(2 * mb, -1);
        std::copy_n(a.begin(), pa, table.begin());
        std::copy_n(b.begin(), pb, table.begin() + mb);
        Blocks indices(a.begin(), a.begin() + pa);
        indices.insert(indices.end(), b.begin(), b.begin() + pb);
        EXPECT_EQ(s.plan.maxBlocks[g], mb);
        EXPECT_EQ(s.groups[g].blockTable, table);
        EXPECT_EQ(s.groups[g].kvIndices, indices);
        EXPECT_EQ(s.groups[g].numPages, (Blocks{pa, pb}));
        EXPECT_EQ(s.groups[g].kvIndptr, (Blocks{0, pa, pa + pb}));
        EXPECT_EQ(s.groups[g].lastPageLens, (Blocks{5 - (pa - 1) * P, 7 - (pb - 1) * P}));
    }
    m.validateStep(s);
    // buffers: a null pointer skips its array; a plan is refused once the manager changed
    StepPlan plan;
    m.planStep(entries.data(), 2, plan);
    Blocks cu(3, 99);
    StepBuffers out;
    out.cuQLens = cu.data();
    m.writeStep(plan, out);
    EXPECT_EQ(cu, (Blocks{0, 5, 6}));
    m.unreserve(20);
    EXPECT_THROW(m.writeStep(plan, out), KVArgumentError);
    StepBatch empty;
    m.buildStep(nullptr, 0, empty);
    EXPECT_EQ(empty.cuQLens, (Blocks{0}));
    EXPECT_EQ(empty.groups[1].kvIndptr, (Blocks{0}));
    EXPECT(empty.groups[1].blockTable.empty());
    std::vector<StepEntry> twice = {{10, 1}, {10, 1}};
    EXPECT_EQ(messageOf([&] { m.buildStep(twice.data(), 2, s); }),
              std::string("build_step: a sequence appears twice in the step: [10, 10]"));
    StepEntry unknown{30, 1}, unreserved{20, -1};
    EXPECT_EQ(messageOf([&] { m.buildStep(&unknown, 1, s); }),
              std::string("build_step: sequence 30 is not in the KV manager"));
    EXPECT_EQ(messageOf([&] { m.buildStep(&unreserved, 1, s); }),
              std::string("build_step: sequence 20 has 0 reserved slot(s) for 0 new token(s); reserve() the step's "
                          "tokens first (and at least 1)"));
    uint64_t addresses[2] = {0x7f0000001000ull, 0x7f0000200000ull};
    int64_t desc[2 * kPoolDescFields];
    m.writePoolDescriptors(addresses, desc);
    EXPECT_EQ(desc[kPoolDescAddress], int64_t(addresses[0]));
    EXPECT_EQ(desc[kPoolDescFields + kPoolDescNumBlocks], 16);
    EXPECT_EQ(desc[kPoolDescFields + 2] + desc[kPoolDescFields + 3], 0);
}

PKV_TEST(commit_rules_for_token_ids) {
    KVManager m({spec("full", 1, 1, 4, 1)}, {8}, {}, true);
    std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
    m.addSequence(1, prompt.data(), 5);
    m.reserve(1, 3);
    std::vector<int32_t> wrong = {1, 9, 3};
    EXPECT_EQ(messageOf([&] { m.commit(1, 3, wrong.data()); }),
              std::string("commit: token_ids of sequence 1 differ from its known tokens at positions [0, 3)"));
    EXPECT_EQ(messageOf([&] { m.commit(1, 4); }),
              std::string("commit: sequence 1 has 3 reserved slot(s), cannot commit 4"));
    EXPECT_EQ(messageOf([&] { m.reserve(1, -1); }),
              std::string("reserve: num_tokens must be >= 0, got -1 (sequence 1)"));
    EXPECT_EQ(messageOf([&] { m.addSequence(1, nullptr, 0); }), std::string("add_sequence: sequence 1 exists already"));
    EXPECT_EQ(messageOf([&] { m.reserve(2, 1); }), std::string("sequence 2 is not in the KV manager"));
    m.commit(1, 3);
    m.reserve(1, 5);
    m.commit(1, 5);  // positions 5..7 without ids: a gap, so page 1 is never registered
    EXPECT_EQ(m.cachedBlocks(0), (Blocks{0}));
    m.validate();
}

PKV_TEST(the_doctor_names_each_corruption) {
    auto healthy = [] {
        KVManager m({spec("full", 1, 1, 4, 2)}, {12}, {2}, true);
        std::vector<int32_t> a = range(1, 11);
        m.addSequence(1, a.data(), 10);
        for (int i = 0; i < 5; ++i) {
            m.reserve(1, 2);
            m.commit(1, 2);
        }
        m.fork(1, 2);
        m.addSequence(3, nullptr, 0);
        m.reserve(3, 3);
        m.validate();
        return m;
    };
    auto doctor = [](KVManager const& m) -> KVInvariantError {
        try {
            m.validate();
        } catch (KVInvariantError const& e) {
            return e;
        }
        return KVInvariantError("(none)", "", {}, "", "");
    };
    {
        KVManager m = healthy();
        int32_t b = m.blockList(1, 0)[0];
        AllocatorTestAccess::refcounts(ManagerTestAccess::impl(m).allocators[0])[b] = 3;
        KVInvariantError e = doctor(m);
        EXPECT_EQ(e.check, std::string("refcount-holders"));
        EXPECT(e.block && *e.block == b && e.seq && *e.seq == 1);
        EXPECT_EQ(e.expected + "/" + e.found, std::string("2/3"));
    }
    {
        KVManager m = healthy();
        KVManager::Impl& impl = ManagerTestAccess::impl(m);
        Sequence& s = impl.slots[impl.index.at(2)];
        int32_t b = s.groups[0].blocks[1];
        s.groups[0].blocks[1] = kInvalidBlock;
        --AllocatorTestAccess::refcounts(impl.allocators[0])[b];
        KVInvariantError e = doctor(m);
        EXPECT_EQ(e.check, std::string("page-in-live-range"));
        EXPECT(e.seq && *e.seq == 2 && e.page && *e.page == 1);
    }
    {
        KVManager m = healthy();
        KVManager::Impl& impl = ManagerTestAccess::impl(m);
        impl.slots[impl.index.at(1)].length = 13;  // 13 tokens need 4 pages, the list holds 3
        KVInvariantError e = doctor(m);
        EXPECT_EQ(e.check, std::string("row-extent"));
        EXPECT_EQ(e.expected + "/" + e.found, std::string("4/3"));
    }
    {
        KVManager m = healthy();
        AllocatorTestAccess::next(ManagerTestAccess::impl(m).allocators[0])[11] = 11;  // a cycle at the tail
        EXPECT_EQ(doctor(m).check, std::string("free-list"));
    }
    {
        KVManager m = healthy();
        KVManager::Impl& impl = ManagerTestAccess::impl(m);
        Sequence& s = impl.slots[impl.index.at(1)];
        s.groups[0].hashedPages = 0;  // the sequence forgets its chain but still holds the node
        s.groups[0].lastNode = 0;
        EXPECT_EQ(doctor(m).check, std::string("prefix-cache"));
    }
    {
        KVManager m = healthy();
        KVManager::Impl& impl = ManagerTestAccess::impl(m);
        impl.slots[impl.index.at(1)].reserved = 2;  // would write into partial page 2, shared with its fork
        KVInvariantError e = doctor(m);
        EXPECT_EQ(e.check, std::string("shared-write"));
        EXPECT(e.seq && *e.seq == 1 && e.page && *e.page == 2);
    }
}

}  // namespace check
}  // namespace pagedkv::runtime
