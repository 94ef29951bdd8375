// Step metadata (step_batch.h): the arrays of pagedkv.kvcache.metadata.build_step_arrays, byte for byte,
// written by plain loops over the step's sequences into caller buffers.
#include <algorithm>
#include <cstring>
#include <limits>

#include "format.h"
#include "kv_manager_impl.h"

namespace pagedkv::runtime {

void KVManager::planStep(StepEntry const* entries, int32_t count, StepPlan& plan) const {
    Impl& m = *impl_;  // the duplicate marks below are scratch; nothing observable changes
    if (count < 0) throw KVArgumentError(cat("build_step: ", count, " entries"), std::nullopt);
    size_t const G = m.groups.size();
    int32_t const B = count;
    plan.seqIds.resize(B);
    plan.slots_.resize(B);
    plan.past_.resize(B);
    plan.q_.resize(B);
    // The Python manager's order of checks: unknown sequences, swapped ones, repeats, reservations.
    for (int32_t i = 0; i < B; ++i) {
        auto it = m.index.find(entries[i].seq);
        if (it == m.index.end())
            throw UnknownSequenceError(cat("build_step: sequence ", entries[i].seq, " is not in the KV manager"),
                                       entries[i].seq);
        plan.seqIds[i] = entries[i].seq;
        plan.slots_[i] = it->second;
    }
    for (int32_t i = 0; i < B; ++i)
        if (m.slots[plan.slots_[i]].swapped)
            throw KVArgumentError(cat("build_step: sequence ", entries[i].seq, " is swapped out; swap_in first"),
                                  entries[i].seq);
    std::vector<int32_t>& seen = m.scratchPages;  // slot marks
    seen.assign(m.slots.size(), 0);
    for (int32_t i = 0; i < B; ++i) {
        if (seen[plan.slots_[i]]++)
            throw KVArgumentError(cat("build_step: a sequence appears twice in the step: ", listRepr(plan.seqIds)),
                                  entries[i].seq);
    }
    int64_t tokens = 0;
    plan.maxQLen = plan.maxKVLen = 0;
    for (int32_t i = 0; i < B; ++i) {
        Sequence const& s = m.slots[plan.slots_[i]];
        int32_t q = entries[i].numNewTokens < 0 ? s.reserved : entries[i].numNewTokens;
        if (q <= 0 || q > s.reserved)
            throw KVArgumentError(cat("build_step: sequence ", s.id, " has ", s.reserved, " reserved slot(s) for ", q,
                                      " new token(s); reserve() the step's tokens first (and at least 1)"),
                                  s.id);
        plan.past_[i] = s.length;
        plan.q_[i] = q;
        tokens += q;
        plan.maxQLen = std::max(plan.maxQLen, q);
        plan.maxKVLen = std::max(plan.maxKVLen, s.length + q);  // < 2^31: reserve checks L + R
    }
    if (tokens > std::numeric_limits<int32_t>::max())
        throw KVArgumentError(cat("build_step: ", tokens, " new tokens overflow the int32 token index"), std::nullopt);
    plan.numSeqs = B;
    plan.numTokens = int32_t(tokens);
    plan.maxBlocks.assign(G, 0);
    plan.numIndices.assign(G, 0);
    plan.pages_.resize(G * B);
    for (size_t g = 0; g < G; ++g) {
        KVLayout const& lay = m.groups[g].layout;
        int64_t nnz = 0;
        for (int32_t i = 0; i < B; ++i) {
            int32_t pages = lay.pagesNeeded(plan.past_[i] + plan.q_[i]);
            plan.pages_[g * B + i] = pages;
            plan.maxBlocks[g] = std::max(plan.maxBlocks[g], pages);
            nnz += pages;
        }
        if (nnz > std::numeric_limits<int32_t>::max() ||
            int64_t(plan.maxBlocks[g]) * B > std::numeric_limits<int32_t>::max())
            throw KVArgumentError(cat("build_step: the step's block table of group ", quoted(m.groups[g].name),
                                      " overflows int32 indices"),
                                  std::nullopt);
        plan.numIndices[g] = int32_t(nnz);
    }
    plan.owner_ = &m;
    plan.version_ = m.version;
}

void KVManager::writeStep(StepPlan const& plan, StepBuffers const& out) const {
    Impl const& m = *impl_;
    if (plan.owner_ != &m || plan.version_ != m.version)
        throw KVArgumentError("write_step: the step plan is stale (the manager changed since planStep)", std::nullopt);
    int32_t const B = plan.numSeqs;
    if (out.cuQLens) {
        int32_t sum = 0;
        out.cuQLens[0] = 0;
        for (int32_t i = 0; i < B; ++i) out.cuQLens[i + 1] = sum += plan.q_[i];
    }
    if (out.pastLens) std::memcpy(out.pastLens, plan.past_.data(), sizeof(int32_t) * B);
    if (out.qLens) std::memcpy(out.qLens, plan.q_.data(), sizeof(int32_t) * B);
    if (out.kvLens)
        for (int32_t i = 0; i < B; ++i) out.kvLens[i] = plan.past_[i] + plan.q_[i];
    if (out.tokenSeq || out.positions) {
        int32_t t = 0;
        for (int32_t i = 0; i < B; ++i) {
            for (int32_t k = 0; k < plan.q_[i]; ++k, ++t) {
                if (out.tokenSeq) out.tokenSeq[t] = i;
                if (out.positions) out.positions[t] = plan.past_[i] + k;
            }
        }
    }
    if (!out.groups) return;
    for (size_t g = 0; g < m.groups.size(); ++g) {
        GroupStepBuffers const& o = out.groups[g];
        KVLayout const& lay = m.groups[g].layout;
        int32_t const MB = plan.maxBlocks[g];
        int32_t const W = o.blockTableWidth > 0 ? o.blockTableWidth : MB;
        if (o.blockTable && W < MB)
            throw KVArgumentError(cat("write_step: block table width ", W, " of group ", quoted(m.groups[g].name),
                                      " is narrower than the step's ", MB, " pages"),
                                  std::nullopt);
        int32_t const* pages = plan.pages_.data() + g * B;
        int32_t nnz = 0;
        if (o.kvIndptr) o.kvIndptr[0] = 0;
        for (int32_t i = 0; i < B; ++i) {
            std::vector<int32_t> const& blocks = m.slots[plan.slots_[i]].groups[g].blocks;
            int32_t n = pages[i];  // <= blocks.size(): a reservation beyond the step keeps its extra pages hidden
            if (o.blockTable) {
                int32_t* row = o.blockTable + int64_t(i) * W;
                std::memcpy(row, blocks.data(), sizeof(int32_t) * n);
                std::fill(row + n, row + W, kInvalidBlock);
            }
            if (o.kvIndices) std::memcpy(o.kvIndices + nnz, blocks.data(), sizeof(int32_t) * n);
            nnz += n;
            if (o.kvIndptr) o.kvIndptr[i + 1] = nnz;
            if (o.numPages) o.numPages[i] = n;
            if (o.lastPageLens)
                o.lastPageLens[i] = n > 0 ? lay.slotsUsed(plan.past_[i] + plan.q_[i]) - (n - 1) * lay.pageSize : 0;
        }
    }
}

void KVManager::buildStep(StepEntry const* entries, int32_t count, StepBatch& out) const {
    planStep(entries, count, out.plan);
    writeStep(out.plan, out.resizeFor(out.plan));
}

StepBuffers StepBatch::resizeFor(StepPlan const& p) {
    int32_t const B = p.numSeqs, T = p.numTokens;
    cuQLens.resize(B + 1);
    pastLens.resize(B);
    qLens.resize(B);
    kvLens.resize(B);
    tokenSeq.resize(T);
    positions.resize(T);
    groups.resize(p.maxBlocks.size());
    groupBuffers_.resize(groups.size());
    for (size_t g = 0; g < groups.size(); ++g) {
        Group& gr = groups[g];
        gr.blockTable.resize(size_t(B) * p.maxBlocks[g]);
        gr.numPages.resize(B);
        gr.lastPageLens.resize(B);
        gr.kvIndptr.resize(B + 1);
        gr.kvIndices.resize(p.numIndices[g]);
        groupBuffers_[g] = {gr.blockTable.data(), 0, gr.numPages.data(), gr.lastPageLens.data(),
                            gr.kvIndptr.data(), gr.kvIndices.data()};
    }
    return {cuQLens.data(),  pastLens.data(),  qLens.data(),        kvLens.data(),
            tokenSeq.data(), positions.data(), groupBuffers_.data()};
}

}  // namespace pagedkv::runtime
