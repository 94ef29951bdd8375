// Iteration-level continuous batching, the twin of `pagedkv.runtime.scheduler.Scheduler` (read its module
// docstring): the same policy, step for step, so that both runtimes schedule the same trace alike
// (tests/test_runtime_native.py compares every step).
//
// Each step (schedule()), within max_num_seqs sequences and max_num_batched_tokens tokens:
//  1. decodes first: every running request whose known tokens are all in the cache takes one token, reserved
//     together (KVManager::reserveMany, all-or-nothing); when the pool is short the newest running request is
//     preempted and the reservation retried;
//  2. prefill chunks of running requests, oldest first, up to chunk_size tokens each; a chunk that does not fit
//     preempts newer requests, with none newer prefills wait;
//  3. swapped-out requests come back (swapIn), oldest first, when their blocks fit;
//  4. waiting requests join first come, first served: the KV manager adopts the longest cached prefix of their
//     tokens (prefix reuse) and their first chunk is reserved, while `watermark` of each pool stays free.
// Priority is arrival order: a request is only preempted for an older one. Preemption "recompute" frees the
// victim's blocks (it is prefilled again, prompt and output); "swap" moves them to the host tier (falling back
// to recompute when the host tier is full).
#pragma once

#include <cstdint>
#include <deque>
#include <unordered_set>
#include <utility>
#include <vector>

#include "pagedkv/runtime/kv_manager.h"
#include "pagedkv/runtime/request.h"

namespace pagedkv::runtime {

enum class Preemption : int32_t { kRecompute = 0, kSwap = 1 };

struct SchedulerConfig {
    int32_t maxNumSeqs = 64;            // sequences per step
    int32_t maxNumBatchedTokens = 2048;  // tokens per step (decodes count one each)
    int32_t chunkSize = 512;            // prefill tokens of one request per step (0: as many as the budget allows)
    Preemption preemption = Preemption::kRecompute;
    double watermark = 0.01;  // fraction of each pool kept free when admitting a new request
    void validate() const;    // std::invalid_argument naming the field (Python's messages)
};

// A step: `decodes` (one token each) then `prefills` (request, tokens), in the step's token order.
struct ScheduledStep {
    std::vector<Request*> decodes;
    std::vector<std::pair<Request*, int32_t>> prefills;
    bool empty() const { return decodes.empty() && prefills.empty(); }
    int32_t numSeqs() const { return int32_t(decodes.size() + prefills.size()); }
    int32_t numTokens() const;
};

struct SchedulerStats {
    int64_t steps = 0;
    int64_t preemptions = 0;  // by recompute
    int64_t swapsOut = 0;
    int64_t swapsIn = 0;
    int64_t prefixTokensReused = 0;
};

class Scheduler {
public:
    Scheduler(KVManager& kv, SchedulerConfig const& config);

    void add(Request* request);     // to the back of the waiting queue
    void remove(Request* request);  // out of whichever queue holds it, its blocks freed (abort)
    void finishMany(std::vector<Request*> const& requests);  // finished running requests leave, blocks freed
    bool hasWork() const { return !waiting_.empty() || !running_.empty() || !swapped_.empty(); }

    // The next step; its KV is reserved. Valid until the next call.
    ScheduledStep const& schedule();

    SchedulerConfig const& config() const { return config_; }
    SchedulerStats const& stats() const { return stats_; }
    std::deque<Request*> const& waiting() const { return waiting_; }
    std::vector<Request*> const& running() const { return running_; }  // arrival order
    std::deque<Request*> const& swapped() const { return swapped_; }

private:
    void preempt(Request* victim);
    int32_t chunk(Request const& r, int32_t budget, int32_t computed) const;
    bool tryReserve(Request const& r, int32_t n, bool admit);
    void insertRunning(Request* r);

    KVManager& kv_;
    SchedulerConfig config_;
    std::deque<Request*> waiting_;
    std::vector<Request*> running_;
    std::deque<Request*> swapped_;
    SchedulerStats stats_;
    std::vector<int64_t> minFree_;                 // [G] blocks a new admission must leave free
    std::unordered_set<Request const*> preempted_;  // not resumed in the step that preempted them
    ScheduledStep step_;
    std::vector<Request*> scratch_;
    std::vector<SeqId> ids_;
    std::vector<int32_t> ones_;
};

}  // namespace pagedkv::runtime
