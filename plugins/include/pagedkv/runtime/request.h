// One generation request inside the C++ engine (the twin of `pagedkv.runtime.request`): its tokens, where it
// stands in the KV cache, and how it ends.
//
// A request's known tokens are its prompt followed by its output; `numComputed` of them have their KV in the
// cache (the KV manager's committed length while it runs). The next step feeds the tokens from there on — a
// prefill chunk, or the last output token as a decode — and when that reaches the last known token, the step's
// logits row for it picks the next token. Preempted by recompute a request loses its KV and is prefilled again,
// prompt and output; preempted by swap its blocks wait in the host tier.
//
// States: kWaiting (not in the KV manager) -> kRunning <-> kSwapped, -> kFinished (kStop at an EOS / stop
// token, kLength at max_new_tokens, kAbort). A request is never in two states.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pagedkv/runtime/sampling.h"

namespace pagedkv::runtime {

using RequestId = int64_t;  // also the request's sequence id in the KV manager

enum class RequestState : int32_t { kWaiting = 0, kRunning = 1, kSwapped = 2, kFinished = 3 };
enum class FinishReason : int32_t { kNone = 0, kStop = 1, kLength = 2, kAbort = 3 };
char const* finishReasonName(FinishReason reason);  // "", "stop", "length", "abort" (Python's values)

// The chosen token's logprob and the SamplingParams::logprobs best alternatives (token, logprob).
struct TokenLogprobs {
    int32_t token;
    float logprob;
    std::vector<std::pair<int32_t, float>> top;
};

struct Request;
// Called after each step that gave the request a token (`token`, and `finished` when it was its last), and
// once with token -1 and `finished` when it is aborted. Called after the step's bookkeeping is done.
using StreamCallback = std::function<void(Request const& request, int32_t token, bool finished)>;

// Fields are the engine's: read them, do not write them.
struct Request {
    RequestId id = 0;
    std::vector<int32_t> prompt;
    SamplingParams params;
    uint64_t arrival = 0;          // order of submission: the scheduler's priority (earlier first)
    uint64_t seed = 0;             // its random stream
    int32_t maxTokens = 0;         // new tokens at most (max_new_tokens resolved against the context limit)
    std::vector<int32_t> stopIds;  // sorted: the model's EOS (unless ignore_eos) and stop_token_ids
    std::vector<int32_t> output;
    std::vector<TokenLogprobs> logprobs;  // one per output token when params.logprobs is set
    int32_t numComputed = 0;
    RequestState state = RequestState::kWaiting;
    FinishReason finishReason = FinishReason::kNone;
    std::optional<Penalties> penalties;  // when params.penalized()
    SamplingRow row{};                   // its sampling_params row (u left 0)
    int32_t numPreemptions = 0;
    StreamCallback callback;

    int32_t numTokens() const { return int32_t(prompt.size() + output.size()); }
    bool finished() const { return state == RequestState::kFinished; }
    int32_t token(int32_t i) const {  // known token i of prompt then output
        int32_t const n = int32_t(prompt.size());
        return i < n ? prompt[i] : output[i - n];
    }
    // Appends the known tokens [start, end) to `out`.
    void tokens(int32_t start, int32_t end, std::vector<int32_t>& out) const;
};

}  // namespace pagedkv::runtime
