// extern "C" entries over KVManager (kv_capi.h): each catches the manager's exceptions and turns them into a
// status code plus a thread-local error record.
#include "pagedkv/runtime/kv_capi.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>

#include "capi_guard.h"
#include "pagedkv/runtime/kv_manager.h"
#include "pagedkv/struct_description.h"

using namespace pagedkv;
using namespace pagedkv::runtime;

namespace {

using namespace pagedkv::runtime::capi;

// `body(manager)` under guarded(), after checking the handle.
template <typename Handle, typename F>
int32_t onManager(Handle* mgr, F&& body) {
    return guarded([&] {
        need(mgr, "manager");
        body(*mgr->manager);
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

// The C API's structs, described for ctypes (pagedkv/struct_description.h; checked at compile time where
// pagedkv_kv_struct_layouts describes them).
using structdesc::FieldDesc;
#define E(f) PKV_FIELD(pagedkv_kv_error, f)
constexpr FieldDesc kError[] = {E(code),   E(has_seq),   E(seq),      E(message),  E(needed), E(free),
                                E(tier),   E(group),     E(what),     E(has_block), E(has_page), E(block),
                                E(page),   E(refcount),  E(check),    E(detail),   E(expected), E(found)};
#undef E
#define G(f) PKV_FIELD(pagedkv_kv_group_desc, f)
constexpr FieldDesc kGroupDesc[] = {G(name),        G(num_layers),       G(num_kv_heads), G(page_size),
                                    G(head_dim),    G(page_layout),      G(ring_sink_tokens), G(cyclic_len),
                                    G(cache_dtype), G(window),           G(attention_sinks), G(num_blocks),
                                    G(host_blocks)};
#undef G
#define S(f) PKV_FIELD(pagedkv_kv_group_stats, f)
constexpr FieldDesc kGroupStats[] = {S(num_blocks), S(num_free), S(host_blocks), S(host_free), S(num_cached)};
#undef S
#define Q(f) PKV_FIELD(pagedkv_kv_seq_info, f)
constexpr FieldDesc kSeqInfo[] = {Q(length), Q(reserved), Q(prompt_len), Q(prefill_remaining), Q(swapped)};
#undef Q
#define C(f) PKV_FIELD(pagedkv_kv_block_copy, f)
constexpr FieldDesc kBlockCopy[] = {C(group), C(src_tier), C(src_block), C(dst_tier), C(dst_block), C(num_tokens)};
#undef C
#define H(f) PKV_FIELD(pagedkv_kv_step_shape, f)
constexpr FieldDesc kStepShape[] = {H(num_seqs), H(num_tokens), H(max_q_len), H(max_kv_len)};
#undef H
#define B(f) PKV_FIELD(pagedkv_kv_step_buffers, f)
constexpr FieldDesc kStepBuffers[] = {B(cu_q_lens), B(past_lens), B(q_lens), B(kv_lens), B(token_seq), B(positions)};
#undef B
#define P(f) PKV_FIELD(pagedkv_kv_group_step_buffers, f)
constexpr FieldDesc kGroupStepBuffers[] = {P(block_table), P(num_pages), P(last_page_lens), P(kv_indptr),
                                           P(kv_indices)};
#undef P
}  // namespace

extern "C" {

int32_t pagedkv_kv_capi_version(void) { return PAGEDKV_KV_CAPI_VERSION; }

const char* pagedkv_kv_struct_layouts(void) {
    static std::string const json = structdesc::describeStructs(
        {PKV_DESCRIBE(pagedkv_kv_error, kError), PKV_DESCRIBE(pagedkv_kv_group_desc, kGroupDesc),
         PKV_DESCRIBE(pagedkv_kv_group_stats, kGroupStats), PKV_DESCRIBE(pagedkv_kv_seq_info, kSeqInfo),
         PKV_DESCRIBE(pagedkv_kv_block_copy, kBlockCopy), PKV_DESCRIBE(pagedkv_kv_step_shape, kStepShape),
         PKV_DESCRIBE(pagedkv_kv_step_buffers, kStepBuffers),
         PKV_DESCRIBE(pagedkv_kv_group_step_buffers, kGroupStepBuffers)});
    return json.c_str();
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
        GroupDescs g = readGroupDescs(groups, num_groups);
        auto handle = std::make_unique<pagedkv_kv_manager>();
        handle->owned =
            std::make_unique<KVManager>(std::move(g.groups), g.numBlocks, g.hostBlocks, enable_prefix_reuse != 0);
        handle->manager = handle->owned.get();
        *out = handle.release();
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

int32_t pagedkv_kv_reserve_all(pagedkv_kv_manager* mgr, const int64_t* seqs, const int32_t* counts, int32_t n) {
    return onManager(mgr, [&](KVManager& m) {
        if (n > 0) {
            need(seqs, "seqs");
            need(counts, "counts");
        }
        m.reserveMany(seqs, counts, n);
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

int32_t pagedkv_kv_num_groups(const pagedkv_kv_manager* mgr) { return mgr ? mgr->manager->numGroups() : 0; }
int32_t pagedkv_kv_num_sequences(const pagedkv_kv_manager* mgr) { return mgr ? mgr->manager->numSequences() : 0; }
int32_t pagedkv_kv_contains(const pagedkv_kv_manager* mgr, int64_t seq) {
    return mgr && mgr->manager->contains(seq) ? 1 : 0;
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
                per.push_back({groups[g].block_table, 0, groups[g].num_pages, groups[g].last_page_lens,
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
