// extern "C" entries over KVManager (kv_capi.h): each catches the manager's exceptions and turns them into a
// status code plus a thread-local error record.
#include "pagedkv/runtime/kv_capi.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>

#include "pagedkv/runtime/kv_manager.h"

using namespace pagedkv;
using namespace pagedkv::runtime;

struct pagedkv_kv_manager {
    KVManager manager;
    StepPlan plan;
};

namespace {

struct ErrorState {
    pagedkv_kv_error record{};
    std::string message, group, what, check, detail, expected, found;

    void reset(int32_t code, std::string msg) {
        record = pagedkv_kv_error{};
        record.code = code;
        message = std::move(msg);
        group.clear();
        what.clear();
        check.clear();
        detail.clear();
        expected.clear();
        found.clear();
    }
    void point() {
        record.message = message.c_str();
        record.group = group.c_str();
        record.what = what.c_str();
        record.check = check.c_str();
        record.detail = detail.c_str();
        record.expected = expected.c_str();
        record.found = found.c_str();
    }
};

thread_local ErrorState tlsError;

void noteSeq(KVCacheError const& e) {
    if (e.seq) {
        tlsError.record.has_seq = 1;
        tlsError.record.seq = *e.seq;
    }
}

// Run `body`, mapping each exception type to its status (the most derived first).
template <typename F>
int32_t guarded(F&& body) {
    try {
        body();
        return PAGEDKV_KV_OK;
    } catch (KVCacheExhaustedError const& e) {
        tlsError.reset(PAGEDKV_KV_EXHAUSTED, e.what());
        noteSeq(e);
        tlsError.record.needed = e.needed;
        tlsError.record.free = e.free;
        tlsError.record.tier = int32_t(e.tier);
        tlsError.group = e.group;
        tlsError.what = e.operation;
    } catch (BlockRefcountError const& e) {
        tlsError.reset(PAGEDKV_KV_REFCOUNT, e.what());
        tlsError.record.has_block = 1;
        tlsError.record.block = e.block;
        tlsError.record.refcount = e.refcount;
    } catch (KVInvariantError const& e) {
        tlsError.reset(PAGEDKV_KV_INVARIANT, e.what());
        noteSeq(e);
        tlsError.group = e.group;
        tlsError.check = e.check;
        tlsError.detail = e.detail;
        tlsError.expected = e.expected;
        tlsError.found = e.found;
        if (e.block) {
            tlsError.record.has_block = 1;
            tlsError.record.block = *e.block;
        }
        if (e.page) {
            tlsError.record.has_page = 1;
            tlsError.record.page = *e.page;
        }
    } catch (UnknownSequenceError const& e) {
        tlsError.reset(PAGEDKV_KV_UNKNOWN_SEQUENCE, e.what());
        noteSeq(e);
    } catch (KVArgumentError const& e) {
        tlsError.reset(PAGEDKV_KV_INVALID_ARGUMENT, e.what());
        noteSeq(e);
    } catch (std::bad_alloc const&) {
        tlsError.reset(PAGEDKV_KV_INTERNAL, "out of host memory");
    } catch (std::exception const& e) {
        tlsError.reset(PAGEDKV_KV_INTERNAL, e.what());
    } catch (...) {
        tlsError.reset(PAGEDKV_KV_INTERNAL, "unknown C++ exception");
    }
    tlsError.point();
    return tlsError.record.code;
}

void need(void const* p, char const* what) {
    if (!p) throw KVArgumentError(std::string(what) + ": null pointer", std::nullopt);
}

// `body(manager)` under guarded(), after checking the handle.
template <typename Handle, typename F>
int32_t onManager(Handle* mgr, F&& body) {
    return guarded([&] {
        need(mgr, "manager");
        body(mgr->manager);
    });
}

void checkGroup(KVManager const& m, int32_t group) {
    if (group < 0 || group >= m.numGroups())
        throw KVArgumentError("group: " + std::to_string(group) + " is not a pool group index (0.." +
                                  std::to_string(m.numGroups() - 1) + ")",
                              std::nullopt);
}

// The capacity protocol of the list queries: `count` always gets the number of values, `out` the values
// when they fit. `values(manager)` computes them.
template <typename T, typename F>
int32_t listOut(pagedkv_kv_manager const* mgr, T* out, int32_t capacity, int32_t* count, F&& values) {
    return onManager(mgr, [&](KVManager const& m) {
        need(count, "count");
        std::vector<T> v = values(m);
        *count = int32_t(v.size());
        if (capacity >= int32_t(v.size()) && !v.empty()) {
            need(out, "out");
            std::copy(v.begin(), v.end(), out);
        }
    });
}

}  // namespace

extern "C" {

int32_t pagedkv_kv_capi_version(void) { return PAGEDKV_KV_CAPI_VERSION; }

int32_t pagedkv_kv_struct_layout(const char* name, int64_t* offsets, int32_t capacity, int64_t* size) {
    if (!name) return -1;
    std::vector<size_t> fields;
    size_t bytes = 0;
#define PKV_LAYOUT(type, ...)            \
    if (std::strcmp(name, #type) == 0) { \
        using T = type;                  \
        fields = {__VA_ARGS__};          \
        bytes = sizeof(T);               \
    }
#define F(field) offsetof(T, field)
    PKV_LAYOUT(pagedkv_kv_error, F(code), F(has_seq), F(seq), F(message), F(needed), F(free), F(tier), F(group),
               F(what), F(has_block), F(has_page), F(block), F(page), F(refcount), F(check), F(detail), F(expected),
               F(found))
    PKV_LAYOUT(pagedkv_kv_group_desc, F(name), F(num_layers), F(num_kv_heads), F(page_size), F(head_dim),
               F(page_layout), F(sink_tokens), F(cyclic_len), F(cache_dtype), F(window), F(attention_sinks),
               F(num_blocks), F(host_blocks))
    PKV_LAYOUT(pagedkv_kv_group_stats, F(num_blocks), F(num_free), F(host_blocks), F(host_free), F(num_cached))
    PKV_LAYOUT(pagedkv_kv_seq_info, F(length), F(reserved), F(prompt_len), F(prefill_remaining), F(swapped))
    PKV_LAYOUT(pagedkv_kv_block_copy, F(group), F(src_tier), F(src_block), F(dst_tier), F(dst_block), F(num_tokens))
    PKV_LAYOUT(pagedkv_kv_step_shape, F(num_seqs), F(num_tokens), F(max_q_len), F(max_kv_len))
    PKV_LAYOUT(pagedkv_kv_step_buffers, F(cu_q_lens), F(past_lens), F(q_lens), F(kv_lens), F(token_seq), F(positions))
    PKV_LAYOUT(pagedkv_kv_group_step_buffers, F(block_table), F(num_pages), F(last_page_lens), F(kv_indptr),
               F(kv_indices))
#undef F
#undef PKV_LAYOUT
    if (fields.empty()) return -1;
    for (size_t i = 0; i < fields.size() && int32_t(i) < capacity && offsets; ++i) offsets[i] = int64_t(fields[i]);
    if (size) *size = int64_t(bytes);
    return int32_t(fields.size());
}

const pagedkv_kv_error* pagedkv_kv_last_error(void) {
    tlsError.point();
    return &tlsError.record;
}

int32_t pagedkv_kv_create(const pagedkv_kv_group_desc* groups, int32_t num_groups, int32_t enable_prefix_reuse,
                          pagedkv_kv_manager** out) {
    return guarded([&] {
        need(out, "out");
        *out = nullptr;
        if (num_groups > 0) need(groups, "groups");
        std::vector<PoolGroupSpec> specs;
        std::vector<int64_t> blocks, host;
        for (int32_t g = 0; g < num_groups; ++g) {
            pagedkv_kv_group_desc const& d = groups[g];
            PoolGroupParams p;
            p.name = d.name ? d.name : "";
            p.numLayers = d.num_layers;
            p.numKVHeads = d.num_kv_heads;
            p.pageSize = d.page_size;
            p.headDim = d.head_dim;
            p.pageLayout = PageLayout(d.page_layout);
            p.sinkTokens = d.sink_tokens;
            p.cyclicLen = d.cyclic_len;
            p.cacheDType = CacheDType(d.cache_dtype);
            p.window = d.window;
            p.attentionSinks = d.attention_sinks;
            specs.push_back(makePoolGroupSpec(p));
            blocks.push_back(d.num_blocks);
            host.push_back(d.host_blocks);
        }
        *out = new pagedkv_kv_manager{KVManager(std::move(specs), blocks, host, enable_prefix_reuse != 0), {}};
    });
}

void pagedkv_kv_destroy(pagedkv_kv_manager* mgr) { delete mgr; }

int32_t pagedkv_kv_add_sequence(pagedkv_kv_manager* mgr, int64_t seq, const int32_t* prompt, int32_t prompt_len,
                                const uint8_t* salt, size_t salt_len, int32_t* reused) {
    return onManager(mgr, [&](auto& m) {
        std::string saltText = salt ? std::string(reinterpret_cast<char const*>(salt), salt_len) : std::string();
        int32_t r = m.addSequence(seq, prompt, prompt_len, saltText);
        if (reused) *reused = r;
    });
}

int32_t pagedkv_kv_reserve(pagedkv_kv_manager* mgr, int64_t seq, int32_t num_tokens) {
    return onManager(mgr, [&](KVManager& m) { m.reserve(seq, num_tokens); });
}

int32_t pagedkv_kv_unreserve(pagedkv_kv_manager* mgr, int64_t seq) {
    return onManager(mgr, [&](KVManager& m) { m.unreserve(seq); });
}

int32_t pagedkv_kv_commit(pagedkv_kv_manager* mgr, int64_t seq, int32_t num_tokens, const int32_t* token_ids,
                          int64_t token_count) {
    return onManager(mgr, [&](KVManager& m) { m.commit(seq, num_tokens, token_ids, token_count); });
}

int32_t pagedkv_kv_free(pagedkv_kv_manager* mgr, int64_t seq) {
    return onManager(mgr, [&](KVManager& m) { m.free(seq); });
}

int32_t pagedkv_kv_fork(pagedkv_kv_manager* mgr, int64_t src, int64_t dst) {
    return onManager(mgr, [&](KVManager& m) { m.fork(src, dst); });
}

int32_t pagedkv_kv_swap_out(pagedkv_kv_manager* mgr, int64_t seq) {
    return onManager(mgr, [&](KVManager& m) { m.swapOut(seq); });
}

int32_t pagedkv_kv_swap_in(pagedkv_kv_manager* mgr, int64_t seq) {
    return onManager(mgr, [&](KVManager& m) { m.swapIn(seq); });
}

int32_t pagedkv_kv_reserve_many(pagedkv_kv_manager* mgr, const int64_t* seqs, const int32_t* counts, int32_t n,
                                int32_t* done) {
    if (done) *done = 0;
    return onManager(mgr, [&](auto& m) {
        if (n > 0) {
            need(seqs, "seqs");
            need(counts, "counts");
        }
        for (int32_t i = 0; i < n; ++i) {
            m.reserve(seqs[i], counts[i]);
            if (done) *done = i + 1;
        }
    });
}

int32_t pagedkv_kv_commit_many(pagedkv_kv_manager* mgr, const int64_t* seqs, const int32_t* counts,
                               const int32_t* token_ids, int32_t n, int32_t* done) {
    if (done) *done = 0;
    return onManager(mgr, [&](auto& m) {
        if (n > 0) {
            need(seqs, "seqs");
            need(counts, "counts");
        }
        int64_t offset = 0;
        for (int32_t i = 0; i < n; ++i) {
            m.commit(seqs[i], counts[i], token_ids ? token_ids + offset : nullptr, token_ids ? counts[i] : -1);
            offset += counts[i];
            if (done) *done = i + 1;
        }
    });
}

int32_t pagedkv_kv_num_groups(const pagedkv_kv_manager* mgr) { return mgr ? mgr->manager.numGroups() : 0; }
int32_t pagedkv_kv_num_sequences(const pagedkv_kv_manager* mgr) { return mgr ? mgr->manager.numSequences() : 0; }
int32_t pagedkv_kv_contains(const pagedkv_kv_manager* mgr, int64_t seq) {
    return mgr && mgr->manager.contains(seq) ? 1 : 0;
}

int32_t pagedkv_kv_sequences(const pagedkv_kv_manager* mgr, int64_t* out, int32_t capacity, int32_t* count) {
    return listOut(mgr, out, capacity, count, [](KVManager const& m) { return m.sequences(); });
}

int32_t pagedkv_kv_sequence_info(const pagedkv_kv_manager* mgr, int64_t seq, pagedkv_kv_seq_info* out) {
    return onManager(mgr, [&](auto& m) {
        need(out, "out");
        *out = {m.length(seq), m.reserved(seq), m.promptLength(seq), m.prefillRemaining(seq), m.isSwapped(seq) ? 1 : 0};
    });
}

int32_t pagedkv_kv_block_list(const pagedkv_kv_manager* mgr, int64_t seq, int32_t group, int32_t* out, int32_t capacity,
                              int32_t* count) {
    return listOut(mgr, out, capacity, count, [&](KVManager const& m) {
        checkGroup(m, group);
        return m.blockList(seq, group);
    });
}

int32_t pagedkv_kv_stats(const pagedkv_kv_manager* mgr, int32_t group, pagedkv_kv_group_stats* out) {
    return onManager(mgr, [&](KVManager const& m) {
        need(out, "out");
        checkGroup(m, group);
        GroupStats s = m.stats(group);
        *out = {s.numBlocks, s.numFree, s.hostBlocks, s.hostFree, s.numCached};
    });
}

int32_t pagedkv_kv_free_list(const pagedkv_kv_manager* mgr, int32_t group, int32_t tier, int32_t* out, int32_t capacity,
                             int32_t* count) {
    return listOut(mgr, out, capacity, count, [&](KVManager const& m) {
        checkGroup(m, group);
        if (tier != 0 && tier != 1)
            throw KVArgumentError("tier: expected 0 (primary) or 1 (secondary), got " + std::to_string(tier),
                                  std::nullopt);
        return m.allocator(group, Tier(tier)).freeList();
    });
}

int32_t pagedkv_kv_cached_blocks(const pagedkv_kv_manager* mgr, int32_t group, int32_t* out, int32_t capacity,
                                 int32_t* count) {
    return listOut(mgr, out, capacity, count, [&](KVManager const& m) {
        checkGroup(m, group);
        return m.cachedBlocks(group);
    });
}

int32_t pagedkv_kv_drain_copies(pagedkv_kv_manager* mgr, pagedkv_kv_block_copy* out, int64_t capacity, int64_t* count) {
    return onManager(mgr, [&](auto& m) {
        need(count, "count");
        std::vector<BlockCopy> const& log = m.copyLog();
        *count = int64_t(log.size());
        if (capacity < int64_t(log.size()) || log.empty()) return;
        need(out, "out");
        for (size_t i = 0; i < log.size(); ++i) {
            BlockCopy const& c = log[i];
            out[i] = {c.group, int32_t(c.srcTier), c.srcBlock, int32_t(c.dstTier), c.dstBlock, c.numTokens};
        }
        m.drainCopies();
    });
}

int32_t pagedkv_kv_plan_step(pagedkv_kv_manager* mgr, const int64_t* seqs, const int32_t* num_new, int32_t num_seqs,
                             pagedkv_kv_step_shape* shape, int32_t* max_blocks, int32_t* num_indices) {
    return onManager(mgr, [&](auto& m) {
        need(shape, "shape");
        if (num_seqs > 0) need(seqs, "seqs");
        std::vector<StepEntry> entries(std::max(0, num_seqs));
        for (int32_t i = 0; i < num_seqs; ++i) entries[i] = {seqs[i], num_new ? num_new[i] : -1};
        m.planStep(entries.data(), num_seqs, mgr->plan);
        StepPlan const& p = mgr->plan;
        *shape = {p.numSeqs, p.numTokens, p.maxQLen, p.maxKVLen};
        for (size_t g = 0; g < p.maxBlocks.size(); ++g) {
            if (max_blocks) max_blocks[g] = p.maxBlocks[g];
            if (num_indices) num_indices[g] = p.numIndices[g];
        }
    });
}

int32_t pagedkv_kv_write_step(pagedkv_kv_manager* mgr, const pagedkv_kv_step_buffers* shared,
                              const pagedkv_kv_group_step_buffers* groups) {
    return onManager(mgr, [&](auto& m) {
        StepBuffers out;
        if (shared) {
            out.cuQLens = shared->cu_q_lens;
            out.pastLens = shared->past_lens;
            out.qLens = shared->q_lens;
            out.kvLens = shared->kv_lens;
            out.tokenSeq = shared->token_seq;
            out.positions = shared->positions;
        }
        std::vector<GroupStepBuffers> per;
        if (groups) {
            for (int32_t g = 0; g < m.numGroups(); ++g)
                per.push_back({groups[g].block_table, groups[g].num_pages, groups[g].last_page_lens,
                               groups[g].kv_indptr, groups[g].kv_indices});
            out.groups = per.data();
        }
        m.writeStep(mgr->plan, out);
    });
}

int32_t pagedkv_kv_pool_descriptors(const pagedkv_kv_manager* mgr, const uint64_t* addresses, int64_t* out) {
    return onManager(mgr, [&](auto& m) {
        need(addresses, "addresses");
        need(out, "out");
        m.writePoolDescriptors(addresses, out);
    });
}

int32_t pagedkv_kv_validate(const pagedkv_kv_manager* mgr) {
    return onManager(mgr, [&](auto& m) { m.validate(); });
}

}  // extern "C"
