// The engine (engine.h): `pagedkv.runtime.engine.Engine`, step for step — the same request checks, seeds,
// stop ids, step inputs (row for row, byte for byte), commits and stops.
#include "pagedkv/runtime/engine.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include "format.h"

namespace pagedkv::runtime {

namespace {

double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The sampling_params row of a greedy row without penalties (Python's SamplingInputs.greedy).
SamplingRow greedyRow() {
    SamplingRow r{};
    r[engine_io::kSamplingTopP] = 1.f;
    r[engine_io::kSamplingRepetitionPenalty] = 1.f;
    return r;
}

}  // namespace

ContextLengthError::~ContextLengthError() = default;

char const* finishReasonName(FinishReason reason) {
    switch (reason) {
        case FinishReason::kNone: return "";
        case FinishReason::kStop: return "stop";
        case FinishReason::kLength: return "length";
        case FinishReason::kAbort: return "abort";
    }
    return "?";
}

void Request::tokens(int32_t start, int32_t end, std::vector<int32_t>& out) const {
    int32_t const n = int32_t(prompt.size());
    for (int32_t i = start; i < std::min(end, n); ++i) out.push_back(prompt[i]);
    for (int32_t i = std::max(start, n); i < end; ++i) out.push_back(output[i - n]);
}

Engine::Engine(Executor& executor, EngineConfig config)
    : executor_(executor), kv_(executor.kv()), config_(std::move(config)), scheduler_(kv_, config_.scheduler) {
    StepLimits const& lim = executor_.limits();
    SchedulerConfig const& s = config_.scheduler;
    if (lim.maxTokens > 0 && s.maxNumBatchedTokens > lim.maxTokens)
        throw std::invalid_argument(cat("max_num_batched_tokens=", s.maxNumBatchedTokens,
                                        " exceeds the engine's maximum of ", lim.maxTokens,
                                        " tokens per step (pagedkv build --max-tokens)"));
    if (lim.maxSeqs > 0 && s.maxNumSeqs > lim.maxSeqs)
        throw std::invalid_argument(cat("max_num_seqs=", s.maxNumSeqs, " exceeds the engine's maximum of ", lim.maxSeqs,
                                        " sequences per step (pagedkv build --max-seqs)"));
    eos_ = config_.eosTokenIds;
    std::sort(eos_.begin(), eos_.end());
    eos_.erase(std::unique(eos_.begin(), eos_.end()), eos_.end());
    int32_t const cap = capacity();
    maxModelLen_ = config_.maxModelLen && *config_.maxModelLen ? std::min(*config_.maxModelLen, cap) : cap;
}

int32_t Engine::capacity() const {
    int64_t limit = std::numeric_limits<int32_t>::max();
    ModelInfo const& model = executor_.model();
    StepLimits const& lim = executor_.limits();
    for (int32_t g = 0; g < kv_.numGroups(); ++g) {
        PoolGroup const& spec = kv_.group(g);
        if (spec.mode != WindowMode::kFull) continue;
        int64_t const page = spec.pageSize();
        limit = std::min(limit, (kv_.stats(g).numBlocks - executor_.heldBlocks(g)) * page);
        if (model.staticMaxBlocks) limit = std::min(limit, int64_t(model.staticMaxBlocks) * page);
        if (size_t(g) < lim.maxBlocks.size() && lim.maxBlocks[g] > 0)  // (a profile's width: C++ only)
            limit = std::min(limit, int64_t(lim.maxBlocks[g]) * page);
    }
    return int32_t(limit);
}

// ---- requests ----------------------------------------------------------------------------------------
int32_t Engine::checkRequest(std::vector<int32_t> const& prompt, SamplingParams const& params) const {
    params.validate();
    if (prompt.empty()) throw std::invalid_argument("prompt: it is empty");
    int32_t const vocab = executor_.model().vocab;
    for (size_t i = 0; i < prompt.size(); ++i)
        if (prompt[i] < 0 || prompt[i] >= vocab)
            throw std::invalid_argument(cat("prompt: token ", prompt[i], " at position ", i,
                                            " is outside the vocabulary [0, ", vocab, ")"));
    int64_t const size = int64_t(prompt.size());
    int64_t const maxTokens = params.maxNewTokens ? *params.maxNewTokens : maxModelLen_ - size;
    if (size + maxTokens > maxModelLen_ || maxTokens < 1)
        throw ContextLengthError(cat("prompt of ", size, " tokens + max_new_tokens ", maxTokens,
                                     " exceed the context limit of ", maxModelLen_, " tokens"));
    int32_t const top = executor_.model().numTopLogprobs;
    if (params.logprobs && *params.logprobs > top)
        throw std::invalid_argument(cat("logprobs: ", *params.logprobs, " exceeds the ", top,
                                        " top logprobs the graph reports (pagedkv rewrite --top-logprobs)"));
    return int32_t(maxTokens);
}

Request const& Engine::addRequest(RequestId id, std::vector<int32_t> prompt, SamplingParams params,
                                  StreamCallback callback) {
    if (requests_.count(id))
        throw std::invalid_argument(cat("request ", id, ": an unfinished request has this id already"));
    if (kv_.contains(id))  // (e.g. the padding sequence of a device executor)
        throw std::invalid_argument(cat("request ", id, ": the id is a sequence of the executor's own"));
    int32_t maxTokens;
    try {
        maxTokens = checkRequest(prompt, params);
    } catch (ContextLengthError const& e) {
        throw ContextLengthError(cat("request ", id, ": ", e.what()));
    } catch (std::invalid_argument const& e) {
        throw std::invalid_argument(cat("request ", id, ": ", e.what()));
    }
    auto r = std::make_unique<Request>();
    r->id = id;
    r->arrival = arrivals_++;
    r->seed = params.seed ? *params.seed : deriveSeed(config_.seed, r->arrival);
    r->maxTokens = maxTokens;
    r->stopIds = params.stopTokenIds;
    if (!params.ignoreEos) r->stopIds.insert(r->stopIds.end(), eos_.begin(), eos_.end());
    std::sort(r->stopIds.begin(), r->stopIds.end());
    r->stopIds.erase(std::unique(r->stopIds.begin(), r->stopIds.end()), r->stopIds.end());
    if (params.penalized()) r->penalties = Penalties::ofPrompt(prompt.data(), int32_t(prompt.size()));
    r->row = params.row();
    r->prompt = std::move(prompt);
    r->params = std::move(params);
    r->callback = std::move(callback);
    Request& ref = *r;
    penalized_ += ref.penalties.has_value();
    requests_.emplace(id, std::move(r));
    scheduler_.add(&ref);
    return ref;
}

Request const* Engine::find(RequestId id) const {
    auto it = requests_.find(id);
    return it == requests_.end() ? nullptr : it->second.get();
}

bool Engine::abort(RequestId id) {
    if (inStep_) throw std::logic_error(cat("abort(", id, "): a step is in flight (between beginStep and endStep)"));
    auto it = requests_.find(id);
    if (it == requests_.end()) return false;
    std::unique_ptr<Request> r = std::move(it->second);
    requests_.erase(it);
    scheduler_.remove(r.get());
    finishRequest(*r, FinishReason::kAbort);
    Request& ref = *r;
    finished_.push_back(std::move(r));
    if (ref.callback) ref.callback(ref, -1, true);
    return true;
}

void Engine::finishRequest(Request& r, FinishReason reason) {
    penalized_ -= r.penalties.has_value();
    r.state = RequestState::kFinished;
    r.finishReason = reason;
}

std::vector<std::unique_ptr<Request>> Engine::takeFinished() {
    std::vector<std::unique_ptr<Request>> out;
    out.swap(finished_);
    samplers_.clear();  // (they may point into what the caller now owns)
    return out;
}

// ---- a step ------------------------------------------------------------------------------------------
std::vector<Request const*> const& Engine::step() {
    if (!beginStep()) {
        samplers_.clear();
        return samplers_;
    }
    StepOutputs out;
    try {
        out = executor_.execute(shape_);
    } catch (...) {
        cancelStep();
        throw;
    }
    return endStep(out);
}

void Engine::run() {
    while (hasUnfinished()) step();
}

bool Engine::beginStep() {
    if (inStep_) throw std::logic_error("beginStep: the previous step has not ended (endStep or cancelStep)");
    t0_ = now();
    plan_ = &scheduler_.schedule();
    if (plan_->empty()) return false;
    ScheduledStep const& plan = *plan_;
    reqs_.assign(plan.decodes.begin(), plan.decodes.end());
    counts_.assign(reqs_.size(), 1);
    for (auto const& [r, n] : plan.prefills) {
        reqs_.push_back(r);
        counts_.push_back(n);
    }
    inStep_ = true;  // from here on the step's reservations are given back if anything fails
    try {
        t1_ = now();
        int32_t const B = int32_t(reqs_.size()), nd = int32_t(plan.decodes.size());
        entries_.resize(B);
        for (int32_t i = 0; i < B; ++i) entries_[i] = {reqs_[i]->id, counts_[i]};
        kv_.planStep(entries_.data(), B, kvPlan_);
        // A chunk that reaches the end of its request's known tokens samples (decodes always do).
        samplerIdx_.clear();
        for (int32_t i = 0; i < B; ++i)
            if (i < nd || reqs_[i]->numComputed + counts_[i] == reqs_[i]->numTokens()) samplerIdx_.push_back(i);
        int32_t width = 1;
        if (penalized_)
            for (int32_t i : samplerIdx_)
                if (reqs_[i]->penalties) width = std::max(width, int32_t(reqs_[i]->penalties->tokens().size()));
        shape_.numSeqs = B;
        shape_.numTokens = kvPlan_.numTokens;
        shape_.numRows = samplerIdx_.empty() ? 1 : int32_t(samplerIdx_.size());  // engines need R >= 1
        shape_.penaltyWidth = width;
        shape_.maxBlocks = kvPlan_.maxBlocks;
        shape_.decodeOnly = shape_.numTokens == B && shape_.numRows == B;
        writeInputs(executor_.layout(shape_));
        t2_ = now();
    } catch (...) {
        cancelStep();
        throw;
    }
    return true;
}

void Engine::writeInputs(StepInputBuffers const& in) {
    int32_t const B = shape_.numSeqs, G = kv_.numGroups();
    groupBuffers_.assign(G, GroupStepBuffers{});
    for (int32_t g = 0; g < G; ++g) {
        groupBuffers_[g].blockTable = in.blockTables[g];
        groupBuffers_[g].blockTableWidth = shape_.tableWidth[g];
    }
    StepBuffers sb;
    sb.cuQLens = in.cuQLens;
    sb.pastLens = in.pastLens;
    sb.positions = in.positionIds;  // cache positions past + i: the RoPE positions the engine takes
    sb.groups = groupBuffers_.data();
    kv_.writeStep(kvPlan_, sb);
    // The tokens: each decode's last known token, then the prefill chunks.
    int64_t t = 0;
    for (int32_t i = 0; i < B; ++i) {
        Request const& r = *reqs_[i];
        for (int32_t k = 0; k < counts_[i]; ++k) in.inputIds[t++] = r.token(r.numComputed + k);
    }
    // One logits row per sampler: its sequence's last token; rows of the sampling head's inputs.
    int32_t const W = shape_.penaltyWidth;
    std::fill(in.penaltyTokens, in.penaltyTokens + int64_t(shape_.numRows) * W, -1);
    std::fill(in.penaltyCounts, in.penaltyCounts + int64_t(shape_.numRows) * W, 0.f);
    if (samplerIdx_.empty()) {  // only prefill chunks short of their prompt's end: one greedy row still runs
        in.logitsRows[0] = shape_.numTokens - 1;
        SamplingRow const g = greedyRow();
        std::copy(g.begin(), g.end(), in.samplingParams);
        return;
    }
    scratch_.assign(B + 1, 0);  // cu_q_lens
    for (int32_t i = 0; i < B; ++i) scratch_[i + 1] = scratch_[i] + counts_[i];
    for (size_t k = 0; k < samplerIdx_.size(); ++k) {
        int32_t const i = samplerIdx_[k];
        Request const& r = *reqs_[i];
        in.logitsRows[k] = scratch_[i + 1] - 1;
        float* row = in.samplingParams + k * engine_io::kSamplingFields;
        std::copy(r.row.begin(), r.row.end(), row);
        row[engine_io::kSamplingUniform] = samplingUniform(r.seed, r.output.size());
        if (r.penalties) {
            std::copy(r.penalties->tokens().begin(), r.penalties->tokens().end(), in.penaltyTokens + k * W);
            std::copy(r.penalties->counts().begin(), r.penalties->counts().end(), in.penaltyCounts + k * W);
        }
    }
}

void Engine::cancelStep() {
    for (Request const* r : reqs_)
        if (kv_.contains(r->id)) kv_.unreserve(r->id);
    reqs_.clear();
    inStep_ = false;
}

std::vector<Request const*> const& Engine::endStep(StepOutputs const& out) {
    if (!inStep_) throw std::logic_error("endStep: no step is in flight (beginStep first)");
    double const t3 = now();
    // Commit: the step's tokens are in the cache. With prefix reuse their ids extend the known tokens (full
    // pages are registered); without it they are not needed.
    bool const ids = kv_.prefixReuse();
    for (size_t i = 0; i < reqs_.size(); ++i) {
        Request& r = *reqs_[i];
        if (ids) {
            scratch_.clear();
            r.tokens(r.numComputed, r.numComputed + counts_[i], scratch_);
            kv_.commit(r.id, counts_[i], scratch_.data(), counts_[i]);
        } else {
            kv_.commit(r.id, counts_[i]);
        }
        r.numComputed += counts_[i];
    }
    kv_.drainCopies();  // the executor ran them; the log would only grow
    inStep_ = false;
    // Tokens and stops.
    samplers_.clear();
    std::vector<Request*> finished;
    for (size_t k = 0; k < samplerIdx_.size(); ++k) {
        Request& r = *reqs_[samplerIdx_[k]];
        int32_t const t = out.nextTokens[k];
        r.output.push_back(t);
        if (r.penalties) r.penalties->addOutput(t);
        if (r.params.logprobs) {
            TokenLogprobs lp{t, out.nextLogprobs ? out.nextLogprobs[k] : 0.f, {}};
            for (int32_t j = 0; j < *r.params.logprobs; ++j)
                lp.top.emplace_back(out.topTokens[k * out.numTop + j], out.topLogprobs[k * out.numTop + j]);
            r.logprobs.push_back(std::move(lp));
        }
        samplers_.push_back(&r);
        if (std::binary_search(r.stopIds.begin(), r.stopIds.end(), t)) {
            finishRequest(r, FinishReason::kStop);
            finished.push_back(&r);
        } else if (int32_t(r.output.size()) >= r.maxTokens) {
            finishRequest(r, FinishReason::kLength);
            finished.push_back(&r);
        }
    }
    if (!finished.empty()) {
        scheduler_.finishMany(finished);
        for (Request* r : finished) {
            auto it = requests_.find(r->id);
            finished_.push_back(std::move(it->second));
            requests_.erase(it);
        }
    }
    reqs_.clear();
    double const t4 = now();
    timing_ = {t1_ - t0_, t2_ - t1_, t3 - t2_, t4 - t3};
    for (Request const* r : samplers_)
        if (r->callback) r->callback(*r, r->output.back(), r->finished());
    return samplers_;
}

}  // namespace pagedkv::runtime
