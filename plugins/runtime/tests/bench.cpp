// Host time of one decode step of the C++ KV manager (the number issue #16 sets a goal for: <= 50 us at 256
// running sequences). Per step: commit the previous step's token and reserve the next for every sequence
// (the bookkeeping), plan the step and write every metadata array into one staging buffer at 256-byte
// aligned offsets (what a device runtime hands to a single cudaMemcpyAsync from pinned memory; plain host
// memory stands in for the pinned buffer here). Medians over the timed steps.
// benchmarks/bench_cpp_kv.py runs it beside the Python manager's numbers.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "commands.h"
#include "pagedkv/runtime/kv_manager.h"

namespace pagedkv::runtime::check {

namespace {

using Clock = std::chrono::steady_clock;

double micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

constexpr size_t kAlign = 256;  // the Python uploader's ALIGN

// The step's arrays at 256-byte aligned offsets of one staging buffer (the packing order of upload.py).
struct Staging {
    std::vector<int32_t> bytes;  // int32 words, 256-byte aligned slices
    StepBuffers buffers;
    GroupStepBuffers group;
    size_t size = 0;

    int32_t* take(size_t count, size_t& offset) {
        int32_t* p = bytes.data() + offset / sizeof(int32_t);
        offset += (count * sizeof(int32_t) + kAlign - 1) / kAlign * kAlign;
        return p;
    }
    void layOut(StepPlan const& plan) {
        size_t B = plan.numSeqs, T = plan.numTokens, MB = plan.maxBlocks[0], NNZ = plan.numIndices[0];
        size_t need = ((B + 1) + 3 * B + 2 * T + B * MB + 3 * (B + 1) + NNZ) * sizeof(int32_t) + 12 * kAlign;
        if (bytes.size() * sizeof(int32_t) < need) bytes.resize(need / sizeof(int32_t) + 1);
        size_t offset = 0;
        buffers.cuQLens = take(B + 1, offset);
        buffers.pastLens = take(B, offset);
        buffers.qLens = take(B, offset);
        buffers.kvLens = take(B, offset);
        buffers.tokenSeq = take(T, offset);
        buffers.positions = take(T, offset);
        group.blockTable = take(B * MB, offset);
        group.numPages = take(B, offset);
        group.lastPageLens = take(B, offset);
        group.kvIndptr = take(B + 1, offset);
        group.kvIndices = take(NNZ, offset);
        buffers.groups = &group;
        size = offset;
    }
};

}  // namespace

int runBench(BenchOptions const& o) {
    PoolGroupParams p;  // llama3-8b's KV geometry (the bookkeeping does not depend on it)
    p.name = "llama3-8b";
    p.numLayers = 32;
    p.numKVHeads = 8;
    p.headDim = 128;
    p.pageSize = o.pageSize;
    int32_t pagesPerSeq = (o.context + o.steps + 1 + o.pageSize - 1) / o.pageSize + 1;
    KVManager m({makePoolGroup(p)}, {int64_t(o.seqs) * pagesPerSeq}, {}, o.prefixReuse);
    std::vector<int32_t> prompt(o.context);
    std::vector<StepEntry> entries;
    for (int32_t s = 0; s < o.seqs; ++s) {
        for (int32_t i = 0; i < o.context; ++i) prompt[i] = 1 + (s * 7919 + i * 31) % 32000;  // distinct prompts
        m.addSequence(s, prompt.data(), o.context);
        m.reserve(s, o.context);
        m.commit(s, o.context);
        m.reserve(s, 1);
        entries.push_back({s, 1});
    }
    Staging staging;
    StepPlan plan;
    std::vector<double> book, planT, write, total;
    int32_t token = 7;
    for (int32_t step = 0; step <= o.steps; ++step) {  // step 0 warms up
        auto t0 = Clock::now();
        m.planStep(entries.data(), int32_t(entries.size()), plan);
        auto t1 = Clock::now();
        staging.layOut(plan);
        m.writeStep(plan, staging.buffers);
        auto t2 = Clock::now();
        for (int32_t s = 0; s < o.seqs; ++s) m.commit(s, 1, &token);
        for (int32_t s = 0; s < o.seqs; ++s) m.reserve(s, 1);
        auto t3 = Clock::now();
        if (step == 0) continue;
        planT.push_back(micros(t1 - t0));
        write.push_back(micros(t2 - t1));
        book.push_back(micros(t3 - t2));
        total.push_back(micros(t3 - t0));
    }
    m.validate();
    std::printf(
        "# C++ KV manager, decode: %d sequences x %d cached tokens, page %d, prefix reuse %s; %d pages in "
        "the step, %zu KiB staged\n",
        o.seqs, o.context, o.pageSize, o.prefixReuse ? "on" : "off", plan.numIndices[0], staging.size / 1024);
    std::printf("plan_step        median %8.1f us\n", median(planT));
    std::printf("write_step       median %8.1f us   (every array into the staging buffer)\n", median(write));
    std::printf("commit+reserve   median %8.1f us   (bookkeeping of the step, %d sequences)\n", median(book), o.seqs);
    std::printf("step total       median %8.1f us   (goal 50 us)\n", median(total));
    std::printf("# reproduce: pagedkv_runtime_check bench --seqs %d --context %d --page-size %d --steps %d%s\n", o.seqs,
                o.context, o.pageSize, o.steps, o.prefixReuse ? " --prefix 1" : "");
    return 0;
}

}  // namespace pagedkv::runtime::check
