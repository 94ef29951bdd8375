// Sampling on the host side, the twin of `pagedkv.runtime.sampling`: a request's parameters, its seeded
// uniform draws, its penalty bookkeeping and its row of the sampling head's `sampling_params` input.
//
// The choice itself happens on the device, in the engine's sampling head (docs/runtime.md, Sampling): the host
// only sends each row's parameters and one uniform draw u. The draws are counter-based: u of a request's k-th
// generated token is draw k of SplitMix64 seeded with the request's seed — the generator's state after k draws
// is seed + k * golden, so a draw needs no state and a request's tokens depend on its seed alone (not on its
// batch, its chunks or preemption). tests/test_runtime_native.py checks every value bit for bit against Python.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "pagedkv/engine_io.h"

namespace pagedkv::runtime {

constexpr uint64_t kSplitMixGolden = 0x9E3779B97F4A7C15ull;

// SplitMix64's output function of `state` (the mix of state + golden).
constexpr uint64_t splitmix64(uint64_t state) {
    uint64_t z = state + kSplitMixGolden;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Draw number `counter` (0, 1, ...) of the stream seeded `seed`, in [0, 1) with 53 random bits.
constexpr double uniformDraw(uint64_t seed, uint64_t counter) {
    return double(splitmix64(seed + counter * kSplitMixGolden) >> 11) * 0x1p-53;
}

// The largest float below 1: the `u` column stays in [0, 1) after rounding to float32.
constexpr double kUniformMax = 1.0 - 0x1p-24;

// The `u` column of a sampling_params row: the draw clamped below 1, rounded to float32.
constexpr float samplingUniform(uint64_t seed, uint64_t counter) {
    double const u = uniformDraw(seed, counter);
    return float(u < kUniformMax ? u : kUniformMax);
}

// A request's seed when it brings none: the mix of the stream seeded `base` (the engine's seed) at `index`
// (its arrival number).
constexpr uint64_t deriveSeed(uint64_t base, uint64_t index) { return splitmix64(base + index * kSplitMixGolden); }

using SamplingRow = std::array<float, engine_io::kSamplingFields>;

// How one request is decoded (Python's SamplingParams; defaults: greedy, 16 new tokens, stop at the model's
// EOS). Stop strings need a tokenizer and are not part of the C++ runtime (docs/runtime-cpp.md).
struct SamplingParams {
    std::optional<int32_t> maxNewTokens = 16;  // nullopt: up to the context limit
    double temperature = 0.0;                  // <= 0: greedy (argmax)
    int32_t topK = 0;                          // 0: off
    double topP = 1.0;                         // 1: off
    double minP = 0.0;                         // 0: off
    double repetitionPenalty = 1.0;            // prompt and output tokens: x / r if x > 0 else x * r
    double presencePenalty = 0.0;              // output tokens: x - presence * [count > 0] - frequency * count
    double frequencyPenalty = 0.0;
    std::optional<uint64_t> seed;              // nullopt: derived from the engine's seed and the arrival
    std::optional<int32_t> logprobs;           // nullopt: none; 0: the chosen token's; n: also the n most likely
    std::vector<int32_t> stopTokenIds;         // end the output (the token is kept)
    bool ignoreEos = false;                    // do not stop at the model's EOS tokens

    // Throws std::invalid_argument naming the field and the value (Python's checks and bounds).
    void validate() const;
    bool penalized() const { return repetitionPenalty != 1.0 || presencePenalty != 0.0 || frequencyPenalty != 0.0; }
    // This request's sampling_params row, the uniform column left 0 (Python's SamplingParams.row()).
    SamplingRow row() const;
};

// The distinct tokens a penalized request's penalties apply to (prompt, then output, in order of first
// appearance) and their counts in the output.
class Penalties {
public:
    static Penalties ofPrompt(int32_t const* prompt, int32_t length);
    void addOutput(int32_t token);
    std::vector<int32_t> const& tokens() const { return tokens_; }
    std::vector<float> const& counts() const { return counts_; }

private:
    std::unordered_map<int32_t, int32_t> index_;  // token -> position in tokens_ / counts_
    std::vector<int32_t> tokens_;
    std::vector<float> counts_;
};

}  // namespace pagedkv::runtime
