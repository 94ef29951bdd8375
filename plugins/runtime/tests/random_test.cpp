// Stateful random test of the C++ KV manager against a model that knows only tokens and lengths (the C++ twin
// of tests/test_kvcache_property.py). Operations: add with prefix hits, prefill chunks, mixed steps,
// speculative steps (reserve more, commit fewer, unreserve), oversized reservations that exhaust the pool,
// fork, free, swap out/in. After each:
//
// * the doctor (validate, validateStep) is clean; lengths, reservations and swap states equal the model's;
// * every live position of every sequence reads back its own token through its block list (writes go where
//   the step metadata and the layout contract put them; copy-on-write and swap copies run from the copy log);
// * after each step's writes, every position its queries attend to reads back (a ring too short would fail);
// * a failed operation changed nothing (the manager equals its copy from before), and a reservation fails only
//   when the model's new pages plus at most one copy per written page exceed the free blocks.
//
// Each episode ends by freeing everything: every block must be free again, and a double free must throw.
#include <algorithm>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>

#include "commands.h"
#include "format.h"
#include "pool_groups.h"
#include "token_pools.h"

namespace pagedkv::runtime::check {

namespace {

constexpr int32_t kMaxSeqs = 7;
constexpr int32_t kMaxToken = 60;

struct Config {
    char const* name;
    std::vector<PoolGroupParams> groups;
    std::vector<int64_t> blocks, hostBlocks;
    bool prefix;
};

// The Python property test's configurations.
std::vector<Config> configs() {
    return {
        // two full-attention groups with different page sizes and layouts: prefix reuse must align them
        {"prefix",
         {groupParams("p4", 2, 1, 4, 2, PageLayout::kHND), groupParams("p8", 1, 2, 8, 1, PageLayout::kNHD)},
         {22, 12},
         {10, 6},
         true},
        // full group + released sliding window (page 3: the divmod path) with sinks
        {"release",
         {groupParams("full", 1, 1, 4, 2, PageLayout::kHND), groupParams("win", 2, 1, 3, 1, PageLayout::kNHD, 5, 2)},
         {20, 24},
         {10, 10},
         false},
        // full group + cyclic ring with sinks and a bubble: sinks 2, bubble 2, ring 8 -> 3 pages
        {"cyclic",
         {groupParams("full", 1, 2, 4, 1, PageLayout::kNHD),
          groupParams("ring", 1, 1, 4, 2, PageLayout::kHND, 5, 2, 2, 8)},
         {20, 14},
         {8, 6},
         false},
    };
}

struct ModelSeq {
    std::vector<int32_t> prompt, tokens;  // tokens: committed
    int32_t reserved = 0;
};

class Violation : public std::runtime_error {
    using std::runtime_error::runtime_error;
};

void require(bool ok, std::string const& what) {
    if (!ok) throw Violation(what);
}

class Episode {
public:
    Episode(Config const& config, uint64_t seed) : rng_(seed), m_(build(config)), pools_(m_) {}

    void step() {
        switch (pick(9)) {
            case 0: add(); break;
            case 1:
            case 2: prefillChunk(); break;
            case 3:
            case 4: mixedStep(); break;
            case 5: speculative(); break;
            case 6: oversizedReserve(); break;
            case 7: pick(2) ? fork() : free(); break;
            default: pick(2) ? swapOut() : swapIn(); break;
        }
        consistent();
    }

    void teardown() {
        for (SeqId id : std::vector<SeqId>(swapped_.begin(), swapped_.end())) {
            try {
                m_.swapIn(id);
            } catch (KVCacheExhaustedError const&) {
                continue;
            }
            swapped_.erase(id);
            pools_.applyCopies(m_.drainCopies());
        }
        for (auto const& [id, s] : model_)
            if (!swapped_.count(id)) checkContents(id, s.tokens);
        for (auto const& [id, s] : model_) m_.free(id);
        m_.validate();
        for (int32_t g = 0; g < m_.numGroups(); ++g) {
            GroupStats st = m_.stats(g);
            require(st.numFree == st.numBlocks, cat("leaked primary blocks in group ", g));
            require(st.hostFree == st.hostBlocks, cat("leaked host blocks in group ", g));
            BlockAllocator copy = m_.allocator(g);
            bool threw = false;
            try {
                if (copy.numBlocks()) copy.decref(0);
            } catch (BlockRefcountError const&) {
                threw = true;
            }
            require(threw || !copy.numBlocks(), "a double free did not throw");
        }
    }

private:
    static KVManager build(Config const& c) {
        std::vector<PoolGroup> specs;
        for (auto const& p : c.groups) specs.push_back(makePoolGroup(p));
        return KVManager(specs, c.blocks, c.hostBlocks, c.prefix);
    }

    int32_t pick(int32_t n) { return int32_t(rng_() % uint64_t(n)); }
    int32_t token() { return 1 + pick(kMaxToken); }

    // The k-th sequence (live only: not swapped out), or -1.
    SeqId choose(int32_t k, bool liveOnly = true) const {
        std::vector<SeqId> ids;
        for (auto const& [id, s] : model_)
            if (!(liveOnly && swapped_.count(id))) ids.push_back(id);
        return ids.empty() ? -1 : ids[k % ids.size()];
    }

    std::vector<int32_t> nextTokens(SeqId id, int32_t n) {
        ModelSeq const& s = model_[id];
        size_t L = s.tokens.size();
        std::vector<int32_t> out;
        for (size_t i = L; i < std::min(s.prompt.size(), L + n); ++i) out.push_back(s.prompt[i]);
        while (int32_t(out.size()) < n) out.push_back(token());
        return out;
    }

    // Reserve through the manager, checking the exhaustion rule and all-or-nothing; returns success.
    bool reserve(SeqId id, int32_t n) {
        ModelSeq& s = model_[id];
        int32_t L = int32_t(s.tokens.size()), R = std::max(s.reserved, n);
        std::vector<int32_t> freeBefore, newPages;
        for (int32_t g = 0; g < m_.numGroups(); ++g) {
            KVLayout const& lay = m_.group(g).layout;
            freeBefore.push_back(m_.stats(g).numFree);
            newPages.push_back(std::max(0, lay.pagesNeeded(L + R) - lay.pagesNeeded(L + s.reserved)));
        }
        KVManager before = m_;
        try {
            m_.reserve(id, n);
        } catch (KVCacheExhaustedError const& e) {
            require(m_ == before, "a failed reserve changed the manager");
            int32_t g = 0;
            while (m_.group(g).name != e.group) ++g;
            require(e.free == freeBefore[g] && e.needed > e.free, "exhaustion numbers differ from the free count");
            require(e.needed >= newPages[g], "exhaustion counted fewer blocks than the new pages");
            int32_t written = (R + m_.group(g).pageSize() - 1) / m_.group(g).pageSize() + 1;
            require(newPages[g] + written > freeBefore[g], "a reservation that fits failed");
            return false;
        } catch (KVArgumentError const& e) {  // a cyclic ring too short for the step
            require(std::string(e.what()).find("cyclic_len") != std::string::npos, e.what());
            require(m_ == before, "a failed reserve changed the manager");
            bool tooShort = false;
            for (int32_t g = 0; g < m_.numGroups(); ++g) {
                PoolGroup const& sp = m_.group(g);
                tooShort |= sp.mode == WindowMode::kCyclic && sp.layout.cyclicLen < sp.window + R - 1;
            }
            require(tooShort, "a ring refused a step it can hold");
            return false;
        }
        for (int32_t g = 0; g < m_.numGroups(); ++g)
            require(freeBefore[g] - m_.stats(g).numFree >= newPages[g], "a reservation took fewer blocks than pages");
        s.reserved = R;
        return true;
    }

    // One engine step of `count[i]` tokens each (all reserved), then commit `commit[i]` of them.
    void runStep(std::vector<std::pair<SeqId, std::vector<int32_t>>> const& entries) {
        if (entries.empty()) return;
        std::vector<StepEntry> step;
        std::vector<std::vector<int32_t>> tokens;
        for (auto const& [id, toks] : entries) {
            step.push_back({id, int32_t(toks.size())});
            tokens.push_back(toks);
        }
        m_.buildStep(step.data(), int32_t(step.size()), batch_);
        m_.validateStep(batch_);
        for (size_t b = 0; b < entries.size(); ++b)
            require(batch_.pastLens[b] == int32_t(model_[entries[b].first].tokens.size()), "past_lens differ");
        pools_.applyCopies(m_.drainCopies());
        pools_.writeStep(m_, batch_, tokens);
        checkStepReads(entries);
        for (auto const& [id, toks] : entries) {
            ModelSeq& s = model_[id];
            bool fromPrompt = s.tokens.size() + toks.size() <= s.prompt.size();
            bool withIds = !fromPrompt && pick(10) != 0;  // sometimes generated tokens come without ids
            m_.commit(id, int32_t(toks.size()), withIds ? toks.data() : nullptr);
            s.tokens.insert(s.tokens.end(), toks.begin(), toks.end());
            s.reserved -= int32_t(toks.size());
        }
    }

    // ---- operations ----
    void add() {
        if (int32_t(model_.size()) >= kMaxSeqs) return;
        std::vector<int32_t> prompt;
        int32_t source = pick(51), keep = pick(41), extra = pick(21);
        if (!prompts_.empty() && source % 3) {  // mostly: start like an earlier prompt (prefix hits)
            auto const& base = prompts_[source % prompts_.size()];
            prompt.assign(base.begin(), base.begin() + keep % (base.size() + 1));
        }
        if (prompt.empty()) extra = std::max(extra, 1);  // extra 0: a prompt that may be all cached blocks
        for (int32_t i = 0; i < extra; ++i) prompt.push_back(token());
        SeqId id = nextId_++;
        int32_t reused = m_.addSequence(id, prompt.data(), int32_t(prompt.size()));
        require(reused >= 0 && reused <= int32_t(prompt.size()) - 1, "reused the whole prompt");
        require(m_.prefixReuse() || reused == 0, "reuse without prefix reuse");
        ModelSeq& s = model_[id];
        s.prompt = prompt;
        s.tokens.assign(prompt.begin(), prompt.begin() + reused);
        prompts_.push_back(prompt);
    }

    int32_t chunkFor(SeqId id, int32_t chunk) {
        ModelSeq const& s = model_[id];
        int32_t left = std::max(0, int32_t(s.prompt.size()) - int32_t(s.tokens.size()));
        return std::min(chunk, left) ? std::min(chunk, left) : 1;  // prompt done: a decode token instead
    }

    void prefillChunk() {
        SeqId id = choose(pick(101));
        if (id < 0) return;
        int32_t n = chunkFor(id, 1 + pick(9));
        if (reserve(id, n)) runStep({{id, nextTokens(id, n)}});
    }

    void mixedStep() {
        std::vector<std::pair<SeqId, std::vector<int32_t>>> entries;
        std::set<SeqId> seen;
        int32_t k = pick(101), width = 2 + pick(3), chunk = 1 + pick(6);
        for (int32_t i = 0; i < width; ++i) {
            SeqId id = choose(k + 3 * i);
            if (id < 0 || seen.count(id)) continue;
            seen.insert(id);
            int32_t n = chunkFor(id, chunk);
            if (reserve(id, n)) entries.push_back({id, nextTokens(id, n)});
        }
        runStep(entries);
    }

    void speculative() {  // drafts: reserve more than the step uses, commit the step, drop the rest
        SeqId id = choose(pick(101));
        if (id < 0) return;
        int32_t used = 1 + pick(3), extra = pick(5);
        if (!reserve(id, used + extra)) return;
        runStep({{id, nextTokens(id, used)}});
        if (pick(2)) {
            m_.unreserve(id);
            model_[id].reserved = 0;
        }
    }

    void oversizedReserve() {  // exhaustion (or a ring too short) must change nothing; a success is undone
        SeqId id = choose(pick(101));
        if (id >= 0 && reserve(id, 1 + pick(64))) {
            m_.unreserve(id);
            model_[id].reserved = 0;
        }
    }

    void fork() {
        SeqId id = choose(pick(101));
        if (id < 0 || int32_t(model_.size()) >= kMaxSeqs) return;
        if (model_[id].reserved) {
            bool threw = false;
            try {
                m_.fork(id, -1);
            } catch (KVArgumentError const&) {
                threw = true;
            }
            require(threw, "fork of a sequence with a reservation did not throw");
            return;
        }
        SeqId child = nextId_++;
        m_.fork(id, child);
        ModelSeq& c = model_[child];
        c.prompt = model_[id].prompt;
        c.tokens = model_[id].tokens;
    }

    void free() {
        SeqId id = choose(pick(101), false);
        if (id < 0) return;
        m_.free(id);
        model_.erase(id);
        swapped_.erase(id);
    }

    void swapOut() {
        SeqId id = choose(pick(101));
        if (id < 0) return;
        if (model_[id].reserved) {
            m_.unreserve(id);
            model_[id].reserved = 0;
        }
        if (allOrNothing([&] { m_.swapOut(id); }, Tier::kSecondary, "swap_out")) swapped_.insert(id);
    }

    void swapIn() {
        if (swapped_.empty()) return;
        std::vector<SeqId> ids(swapped_.begin(), swapped_.end());
        SeqId id = ids[pick(101) % ids.size()];
        if (allOrNothing([&] { m_.swapIn(id); }, Tier::kPrimary, "swap_in")) swapped_.erase(id);
    }

    // Run `op`; running out of `tier` must change nothing. Returns whether it succeeded.
    template <typename Op>
    bool allOrNothing(Op&& op, Tier tier, char const* what) {
        KVManager before = m_;
        try {
            op();
        } catch (KVCacheExhaustedError const& e) {
            require(e.tier == tier && m_ == before, cat("a failed ", what, " changed the manager"));
            return false;
        }
        return true;
    }

    // ---- checks ----
    void checkContents(SeqId id, std::vector<int32_t> const& tokens) {
        int32_t L = int32_t(tokens.size());
        for (int32_t g = 0; g < m_.numGroups(); ++g) {
            PoolGroup const& sp = m_.group(g);
            // Positions a future query may still read: all, or the sinks plus the last window (released) /
            // the last cyclic_len (ring); the tests' own statement, not the manager's.
            int32_t span = sp.layout.cyclicLen ? sp.layout.cyclicLen : sp.window - 1;
            for (int32_t pos = 0; pos < L; ++pos) {
                bool live = sp.window <= 0 || pos < sp.attentionSinks || pos >= L - span;
                if (!live) continue;
                int32_t got = pools_.read(g, m_.blockList(id, g), pos);
                require(got == tokens[pos], cat("sequence ", id, " group ", sp.name, " position ", pos, ": read ", got,
                                                ", wrote ", tokens[pos]));
            }
        }
    }

    void checkStepReads(std::vector<std::pair<SeqId, std::vector<int32_t>>> const& entries) {
        for (int32_t g = 0; g < m_.numGroups(); ++g) {
            PoolGroup const& sp = m_.group(g);
            for (size_t b = 0; b < entries.size(); ++b) {
                SeqId id = entries[b].first;
                std::vector<int32_t> after = model_[id].tokens;
                after.insert(after.end(), entries[b].second.begin(), entries[b].second.end());
                int32_t p0 = batch_.pastLens[b], end = int32_t(after.size());
                for (int32_t kv = 0; kv < end; ++kv) {
                    if (!attends(std::max(p0, kv), kv, sp.window, sp.attentionSinks)) continue;  // nearest query
                    int32_t got = pools_.read(g, m_.blockList(id, g), kv);
                    require(got == after[kv], cat("step: sequence ", id, " group ", sp.name, " position ", kv,
                                                  " the step attends to reads ", got, ", not ", after[kv]));
                }
            }
        }
    }

    void consistent() {
        pools_.applyCopies(m_.drainCopies());  // e.g. the copy-on-write of a reservation undone later
        m_.validate();
        require(m_.numSequences() == int32_t(model_.size()), "sequence count differs");
        for (auto const& [id, s] : model_) {
            require(m_.length(id) == int32_t(s.tokens.size()), cat("length of ", id));
            require(m_.reserved(id) == s.reserved, cat("reservation of ", id));
            require(m_.isSwapped(id) == (swapped_.count(id) != 0), cat("swap state of ", id));
            if (!swapped_.count(id)) checkContents(id, s.tokens);
        }
    }

    std::mt19937_64 rng_;
    KVManager m_;
    TokenPools pools_;
    StepBatch batch_;
    std::map<SeqId, ModelSeq> model_;
    std::set<SeqId> swapped_;
    std::vector<std::vector<int32_t>> prompts_;
    SeqId nextId_ = 0;
};

}  // namespace

int runRandom(int64_t operations, uint64_t seed, int32_t stepsPerEpisode) {
    std::vector<Config> const all = configs();
    int64_t done = 0;
    int64_t episodes = 0;
    while (done < operations) {
        Config const& config = all[episodes % all.size()];
        uint64_t episodeSeed = seed * 1000003ull + uint64_t(episodes);
        Episode episode(config, episodeSeed);
        int32_t i = 0;
        try {
            for (; i < stepsPerEpisode && done < operations; ++i, ++done) episode.step();
            episode.teardown();
        } catch (std::exception const& e) {
            std::cout << "FAIL random: config " << config.name << ", episode seed " << episodeSeed << ", operation "
                      << i << ": " << e.what() << "\n0 passed, 1 failed" << std::endl;
            return 1;
        }
        ++episodes;
    }
    std::cout << "random: " << done << " operations in " << episodes << " episodes (seed " << seed << ")\n"
              << "1 passed, 0 failed" << std::endl;
    return 0;
}

}  // namespace pagedkv::runtime::check
