// SamplingParams checks (Python's SamplingParams.__post_init__, same bounds and wording) and the penalty
// bookkeeping (Python's Penalties).
#include "pagedkv/runtime/sampling.h"

#include <cmath>
#include <stdexcept>

#include "format.h"

namespace pagedkv::runtime {

namespace {

void checkBounded(char const* name, double v, double low, double high, bool hasHigh) {
    if (!std::isfinite(v) || v < low || (hasHigh && v > high)) {
        std::string bound = hasHigh ? cat("in [", pyNumber(low), ", ", pyNumber(high), "]") : cat(">= ", pyNumber(low));
        throw std::invalid_argument(cat(name, ": expected a finite number ", bound, ", got ", pyFloat(v)));
    }
}

}  // namespace

void SamplingParams::validate() const {
    if (maxNewTokens && *maxNewTokens < 1)
        throw std::invalid_argument(cat("max_new_tokens: expected an integer >= 1 or None, got ", *maxNewTokens));
    checkBounded("temperature", temperature, 0.0, 0.0, false);
    checkBounded("top_p", topP, 0.0, 1.0, true);
    checkBounded("min_p", minP, 0.0, 1.0, true);
    checkBounded("presence_penalty", presencePenalty, -2.0, 2.0, true);
    checkBounded("frequency_penalty", frequencyPenalty, -2.0, 2.0, true);
    if (topP == 0.0) throw std::invalid_argument("top_p: must be > 0 (1 turns it off), got 0");
    if (!std::isfinite(repetitionPenalty) || repetitionPenalty <= 0)
        throw std::invalid_argument(
            cat("repetition_penalty: expected a finite number > 0, got ", pyFloat(repetitionPenalty)));
    if (topK < 0) throw std::invalid_argument(cat("top_k: expected an integer >= 0, got ", topK));
    if (logprobs && *logprobs < 0) throw std::invalid_argument(cat("logprobs: expected an integer >= 0, got ", *logprobs));
    for (int32_t t : stopTokenIds)
        if (t < 0)
            throw std::invalid_argument(cat("stop_token_ids: expected token ids >= 0, got ", listRepr(stopTokenIds)));
}

SamplingRow SamplingParams::row() const {
    SamplingRow r{};
    r[engine_io::kSamplingTemperature] = float(temperature);
    r[engine_io::kSamplingTopK] = float(topK);
    r[engine_io::kSamplingTopP] = float(topP);
    r[engine_io::kSamplingMinP] = float(minP);
    r[engine_io::kSamplingRepetitionPenalty] = float(repetitionPenalty);
    r[engine_io::kSamplingPresencePenalty] = float(presencePenalty);
    r[engine_io::kSamplingFrequencyPenalty] = float(frequencyPenalty);
    return r;
}

Penalties Penalties::ofPrompt(int32_t const* prompt, int32_t length) {
    Penalties p;
    for (int32_t i = 0; i < length; ++i) {
        if (p.index_.emplace(prompt[i], int32_t(p.tokens_.size())).second) {
            p.tokens_.push_back(prompt[i]);
            p.counts_.push_back(0.f);
        }
    }
    return p;
}

void Penalties::addOutput(int32_t token) {
    auto [it, fresh] = index_.emplace(token, int32_t(tokens_.size()));
    if (fresh) {
        tokens_.push_back(token);
        counts_.push_back(1.f);
    } else {
        counts_[it->second] += 1.f;
    }
}

}  // namespace pagedkv::runtime
