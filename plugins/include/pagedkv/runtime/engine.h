// The C++ engine: requests in, one step at a time — schedule, execute, sample, stop — tokens out. The twin of
// `pagedkv.runtime.engine.Engine`, with the same semantics (tests/test_runtime_native.py runs one trace through
// both and compares every step's schedule, engine inputs and outputs).
//
//   HostExecutor / a TensorRT executor (trt_engine.h) ...
//   Engine engine(executor, config);
//   engine.addRequest(7, prompt, params, [](Request const& r, int32_t token, bool finished) { ... });
//   while (engine.hasUnfinished()) engine.step();
//
// A step: the scheduler picks decodes and prefill chunks and reserves their KV (scheduler.h); the engine writes
// the step's engine inputs where the executor wants them (block tables, cu_q_lens, past_lens, positions, input
// ids, logits rows, each sampling request's parameter row with its SplitMix64 draw, penalty rows); the
// executor runs the step and its sampling head picks the next token of every request whose known tokens are now
// all in the cache; the step is committed; each sampled request gets its token (and logprobs when asked for)
// and is finished at an EOS / stop token, max_new_tokens or the context limit — its blocks freed at once.
// Stop strings need a tokenizer and are not part of the C++ runtime. The engine is single-threaded.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "pagedkv/runtime/executor.h"
#include "pagedkv/runtime/request.h"
#include "pagedkv/runtime/scheduler.h"

namespace pagedkv::runtime {

// prompt + max_new_tokens beyond the context limit (Python: ContextLengthError, a ValueError).
class ContextLengthError : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
    ~ContextLengthError() override;
};

struct EngineConfig {
    SchedulerConfig scheduler;
    std::optional<int32_t> maxModelLen;  // context limit; default (and cap): what one sequence can hold
    std::vector<int32_t> eosTokenIds;    // the model's EOS ids, where generation stops
    uint64_t seed = 0;                   // base of the seeds of requests that bring none
};

// Host seconds of the last step's phases (Python's StepTiming).
struct StepTiming {
    double schedule = 0;  // scheduler + KV reservations
    double prepare = 0;   // step metadata, input ids, sampling rows into the executor's buffers
    double execute = 0;   // the executor: block copies, upload, the model, reading back the tokens
    double finish = 0;    // commit, tokens, stops, frees
    double host() const { return schedule + prepare + finish; }
};

class Engine {
public:
    // Throws std::invalid_argument when the scheduler's limits exceed the executor's (naming both).
    Engine(Executor& executor, EngineConfig config);
    Engine(Engine const&) = delete;
    Engine& operator=(Engine const&) = delete;

    // Validate a request without touching the engine: std::invalid_argument for a bad prompt or parameters,
    // ContextLengthError when prompt + max_new_tokens exceed the context limit. Returns max_new_tokens resolved.
    int32_t checkRequest(std::vector<int32_t> const& prompt, SamplingParams const& params) const;
    // Queue a request (checkRequest's errors, prefixed "request <id>: "; an unfinished request with this id).
    Request const& addRequest(RequestId id, std::vector<int32_t> prompt, SamplingParams params = {},
                              StreamCallback callback = {});
    // End an unfinished request now, its KV blocks freed at once; false when there is none.
    bool abort(RequestId id);
    bool hasUnfinished() const { return !requests_.empty(); }
    Request const* find(RequestId id) const;  // an unfinished request, or null

    // One step: beginStep, the executor, endStep (an executor error gives the step's reservations back and
    // propagates). Returns the requests that got a token (finished ones included), valid until the next step.
    std::vector<Request const*> const& step();
    // Step until every request has finished.
    void run();

    // The two halves of step(), for a caller that runs the executor itself (the C API): beginStep schedules and
    // writes the inputs (false: nothing to run); endStep takes the outputs.
    bool beginStep();
    StepShape const& stepShape() const { return shape_; }
    ScheduledStep const& scheduledStep() const { return *plan_; }
    std::vector<Request const*> const& endStep(StepOutputs const& outputs);
    void cancelStep();  // the step will not run: its reservations are given back

    // Requests finished (or aborted) since the last call, in the order they finished.
    std::vector<std::unique_ptr<Request>> takeFinished();

    int32_t maxModelLen() const { return maxModelLen_; }
    Scheduler const& scheduler() const { return scheduler_; }
    StepTiming const& timing() const { return timing_; }
    Executor& executor() { return executor_; }

private:
    int32_t capacity() const;
    void writeInputs(StepInputBuffers const& in);
    void finishRequest(Request& r, FinishReason reason);

    Executor& executor_;
    KVManager& kv_;
    EngineConfig config_;
    Scheduler scheduler_;
    std::vector<int32_t> eos_;  // sorted, unique
    int32_t maxModelLen_ = 0;
    uint64_t arrivals_ = 0;
    int64_t penalized_ = 0;  // unfinished requests with penalties
    std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;  // unfinished
    std::vector<std::unique_ptr<Request>> finished_;
    StepTiming timing_;
    bool inStep_ = false;

    // the step in flight
    ScheduledStep const* plan_ = nullptr;
    std::vector<Request*> reqs_;       // decodes, then prefill chunks
    std::vector<StepEntry> entries_;   // their KV step entries
    std::vector<int32_t> counts_;      // their new tokens
    std::vector<int32_t> samplerIdx_;  // rows: indices into reqs_
    std::vector<Request const*> samplers_;
    StepPlan kvPlan_;
    StepShape shape_;
    std::vector<GroupStepBuffers> groupBuffers_;
    std::vector<int32_t> scratch_;
    std::vector<SeqId> ids_;
    double t0_ = 0, t1_ = 0, t2_ = 0;
};

}  // namespace pagedkv::runtime
