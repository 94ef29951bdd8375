// The scheduler (scheduler.h): `pagedkv.runtime.scheduler.Scheduler.schedule`, statement for statement.
#include "pagedkv/runtime/scheduler.h"

#include <algorithm>
#include <stdexcept>

#include "format.h"

namespace pagedkv::runtime {

void SchedulerConfig::validate() const {
    if (maxNumSeqs < 1) throw std::invalid_argument(cat("max_num_seqs: must be >= 1, got ", maxNumSeqs));
    if (maxNumBatchedTokens < 1)
        throw std::invalid_argument(cat("max_num_batched_tokens: must be >= 1, got ", maxNumBatchedTokens));
    if (maxNumBatchedTokens < maxNumSeqs)
        throw std::invalid_argument(cat("max_num_batched_tokens=", maxNumBatchedTokens, " < max_num_seqs=", maxNumSeqs,
                                        ": a step of decodes alone would not fit the budget"));
    if (chunkSize < 0)
        throw std::invalid_argument(cat("chunk_size: must be >= 0 (0: the token budget), got ", chunkSize));
    if (preemption != Preemption::kRecompute && preemption != Preemption::kSwap)
        throw std::invalid_argument(cat("preemption: expected 0 (recompute) or 1 (swap), got ", int32_t(preemption)));
    if (!(watermark >= 0.0 && watermark < 1.0))
        throw std::invalid_argument(cat("watermark: expected a fraction in [0, 1), got ", pyFloat(watermark)));
}

int32_t ScheduledStep::numTokens() const {
    int32_t n = int32_t(decodes.size());
    for (auto const& p : prefills) n += p.second;
    return n;
}

Scheduler::Scheduler(KVManager& kv, SchedulerConfig const& config) : kv_(kv), config_(config) {
    config_.validate();
    for (int32_t g = 0; g < kv_.numGroups(); ++g)
        minFree_.push_back(int64_t(config_.watermark * double(kv_.stats(g).numBlocks)));
}

// ---- queues ------------------------------------------------------------------------------------------
void Scheduler::add(Request* request) {
    request->state = RequestState::kWaiting;
    waiting_.push_back(request);
}

void Scheduler::remove(Request* request) {
    auto drop = [request](auto& queue) { queue.erase(std::find(queue.begin(), queue.end(), request)); };
    switch (request->state) {
        case RequestState::kWaiting: drop(waiting_); break;
        case RequestState::kRunning:
            drop(running_);
            kv_.free(request->id);
            break;
        case RequestState::kSwapped:
            drop(swapped_);
            kv_.free(request->id);
            break;
        case RequestState::kFinished: break;
    }
}

void Scheduler::finishMany(std::vector<Request*> const& requests) {
    for (Request* r : requests) kv_.free(r->id);
    std::unordered_set<Request*> gone(requests.begin(), requests.end());
    running_.erase(std::remove_if(running_.begin(), running_.end(), [&](Request* r) { return gone.count(r) != 0; }),
                   running_.end());
}

// ---- preemption --------------------------------------------------------------------------------------
void Scheduler::preempt(Request* victim) {
    auto& decodes = step_.decodes;
    decodes.erase(std::remove(decodes.begin(), decodes.end(), victim), decodes.end());
    auto& prefills = step_.prefills;
    prefills.erase(std::remove_if(prefills.begin(), prefills.end(), [victim](auto const& p) { return p.first == victim; }),
                   prefills.end());
    if (kv_.reserved(victim->id)) kv_.unreserve(victim->id);
    running_.erase(std::find(running_.begin(), running_.end(), victim));
    ++victim->numPreemptions;
    preempted_.insert(victim);
    if (config_.preemption == Preemption::kSwap) {
        bool swapped = true;
        try {
            kv_.swapOut(victim->id);
        } catch (KVCacheExhaustedError const&) {  // the host tier is full: recompute instead
            swapped = false;
        }
        if (swapped) {
            victim->state = RequestState::kSwapped;
            auto at = std::upper_bound(swapped_.begin(), swapped_.end(), victim,
                                       [](Request const* a, Request const* b) { return a->arrival < b->arrival; });
            swapped_.insert(at, victim);
            ++stats_.swapsOut;
            return;
        }
    }
    kv_.free(victim->id);
    victim->numComputed = 0;
    victim->state = RequestState::kWaiting;
    waiting_.push_front(victim);  // older than anything waiting: it was admitted first
    ++stats_.preemptions;
}

// ---- the step ----------------------------------------------------------------------------------------
ScheduledStep const& Scheduler::schedule() {
    SchedulerConfig const& cfg = config_;
    step_.decodes.clear();
    step_.prefills.clear();
    preempted_.clear();
    for (Request* r : running_)
        if (r->numComputed == r->numTokens() - 1) step_.decodes.push_back(r);
    while (!step_.decodes.empty()) {
        ids_.clear();
        for (Request* r : step_.decodes) ids_.push_back(r->id);
        ones_.assign(ids_.size(), 1);
        try {
            kv_.reserveMany(ids_.data(), ones_.data(), int32_t(ids_.size()));
            break;
        } catch (KVCacheExhaustedError const&) {
            preempt(running_.back());
        }
    }
    scratch_.clear();
    for (Request* r : running_)
        if (r->numComputed < r->numTokens() - 1) scratch_.push_back(r);
    std::vector<Request*> const prefilling = scratch_;  // (preemption below changes running_)
    for (Request* r : prefilling) {
        if (r->state != RequestState::kRunning) continue;  // preempted for an older request's chunk meanwhile
        int32_t budget = cfg.maxNumBatchedTokens - step_.numTokens();
        if (budget <= 0 || step_.numSeqs() >= cfg.maxNumSeqs) break;
        int32_t n = chunk(*r, budget, r->numComputed);
        while (!tryReserve(*r, n, false)) {
            Request* newest = nullptr;
            for (Request* v : running_)
                if (v->arrival > r->arrival) newest = v;
            if (!newest) {
                n = 0;
                break;
            }
            preempt(newest);
        }
        if (!n) break;
        step_.prefills.emplace_back(r, n);
    }
    int32_t budget = cfg.maxNumBatchedTokens - step_.numTokens();
    int32_t seqs = step_.numSeqs();
    while (!swapped_.empty() && budget > 0 && seqs < cfg.maxNumSeqs && int32_t(running_.size()) < cfg.maxNumSeqs) {
        Request* r = swapped_.front();
        if (preempted_.count(r)) break;
        try {
            kv_.swapIn(r->id);
        } catch (KVCacheExhaustedError const&) {
            break;
        }
        swapped_.pop_front();
        r->state = RequestState::kRunning;
        insertRunning(r);
        ++stats_.swapsIn;
    }
    while (!waiting_.empty() && budget > 0 && seqs < cfg.maxNumSeqs && int32_t(running_.size()) < cfg.maxNumSeqs) {
        Request* r = waiting_.front();
        if (preempted_.count(r)) break;
        std::vector<int32_t> tokens;
        r->tokens(0, r->numTokens(), tokens);
        int32_t reused = kv_.addSequence(r->id, tokens.data(), int32_t(tokens.size()));
        int32_t n = chunk(*r, budget, reused);
        if (!tryReserve(*r, n, true)) {
            kv_.free(r->id);
            break;
        }
        waiting_.pop_front();
        r->numComputed = reused;
        stats_.prefixTokensReused += reused;
        r->state = RequestState::kRunning;
        insertRunning(r);
        step_.prefills.emplace_back(r, n);
        budget -= n;
        seqs += 1;
    }
    if (!step_.empty()) ++stats_.steps;
    return step_;
}

int32_t Scheduler::chunk(Request const& r, int32_t budget, int32_t computed) const {
    int32_t n = std::min(r.numTokens() - computed, budget);
    return config_.chunkSize ? std::min(n, config_.chunkSize) : n;
}

bool Scheduler::tryReserve(Request const& r, int32_t n, bool admit) {
    try {
        kv_.reserve(r.id, n);
    } catch (KVCacheExhaustedError const&) {
        return false;
    }
    if (admit && !running_.empty()) {
        for (int32_t g = 0; g < kv_.numGroups(); ++g) {
            if (kv_.stats(g).numFree < minFree_[g]) {
                kv_.unreserve(r.id);
                return false;
            }
        }
    }
    return true;
}

void Scheduler::insertRunning(Request* r) {
    auto at = running_.end();
    while (at != running_.begin() && (*(at - 1))->arrival > r->arrival) --at;
    running_.insert(at, r);
}

}  // namespace pagedkv::runtime
