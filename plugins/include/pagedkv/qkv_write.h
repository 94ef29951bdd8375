// Fused QKV preprocess + paged KV write: parameters and launcher (kernels/qkv_write*.cu implement it).
//
//   T tokens, H query heads, KVH KV heads, D head_dim, R rotary dims (<= D, even)
//   qkv   [T, (H + 2*KVH) * D]  fp16|bf16, rows = tokens, columns = [q heads | k heads | v heads]
//   bias  [(H + 2*KVH) * D]     same dtype, optional
//   qOut  [T, H * D]            fp16|bf16 like qkv, or fp8 e4m3 (qOutFP8, divided by qScale)
//   pool  through meta.poolDescs[meta.poolIndex] (the layout's dtype, see kv_layout.h)
//   status [kStatusFields] int32 (step_metadata.h), must be zeroed by the caller before the launch
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "pagedkv/capabilities.h"  // IODType, kMaxRotaryPairs, the supported head dims
#include "pagedkv/kv_layout.h"
#include "pagedkv/last_error.h"
#include "pagedkv/step_metadata.h"

namespace pagedkv {

enum class RopeStyle : int32_t {
    kNone = 0,
    kNeox = 1,  // GPT-NeoX: pairs (i, i + R/2), "rotate half"
    kGptj = 2,  // GPT-J: pairs (2i, 2i + 1), interleaved
};

enum class RopeScaling : int32_t {
    kNone = 0,
    kLinear = 1,    // inv_freq / factor
    kLlama3 = 2,    // Llama-3 smooth wavelength-dependent scaling
    kYarn = 3,      // YaRN: a linear ramp over dims [low, high] (from beta_fast, beta_slow, original_max_positions)
                    // from the unchanged to the interpolated (/ factor) frequencies; cos and sin times the attention
                    // factor
    kLongRope = 4,  // LongRoPE: per-pair short factors (inv_freq / short[i]); a sequence whose kv length after the
                    // step exceeds original_max_positions rotates with the long factors instead; attention factor
};
// Every scaling changes only the inverse frequencies (two tables for LongRoPE) and the attention factor
// (RopeParams::mscale): the kernel takes tables and a multiplier, not a formula.

struct RopeParams {
    RopeStyle style;
    int32_t rotaryDim;   // R, even, <= D; dims >= R pass through
    float mscale;        // multiplies cos and sin (the attention factor of YaRN / LongRoPE; 1 otherwise)
    // LongRoPE: > 0, the tokens of a sequence whose kv length after this step (past_len + its new tokens) exceeds
    // it rotate with longInvFreq, the others with invFreq; cached keys keep the rotation they were written with.
    // 0: invFreq for every token (longInvFreq unused).
    int32_t longAboveKVLen;
    float invFreq[kMaxRotaryPairs];      // [R/2] angle = position * invFreq[i]; computed by computeRopeParams
    float longInvFreq[kMaxRotaryPairs];  // [R/2] with longAboveKVLen > 0
};

struct RopeConfig {  // the user-facing description (plugin attributes), turned into RopeParams on the host
    RopeStyle style = RopeStyle::kNeox;
    int32_t rotaryDim = 0;  // 0 -> head_dim
    float theta = 10000.f;
    RopeScaling scaling = RopeScaling::kNone;
    float factor = 1.f;     // linear, llama3, yarn: the context extension; longrope: only its attention factor's
    float lowFreqFactor = 1.f;   // llama3
    float highFreqFactor = 4.f;  // llama3
    int32_t originalMaxPositions = 8192;  // llama3, yarn, longrope (the switch to the long factors)
    float betaFast = 32.f;  // yarn: rotations that bound the extrapolated (unchanged) dims
    float betaSlow = 1.f;   // yarn: rotations that bound the interpolated dims
    int32_t truncate = 1;   // yarn: 1 rounds the ramp's bounds outward to whole dims (floor low, ceil high)
    // yarn, longrope: multiplies cos and sin; 0 -> Hugging Face's default from factor (yarn: 0.1 ln(factor) + 1,
    // longrope: sqrt(1 + ln(factor) / ln(original_max_positions)); 1 when factor <= 1)
    float attentionFactor = 0.f;
    int32_t numFactors = 0;                  // longrope: R/2 (the length of both factor lists)
    float shortFactors[kMaxRotaryPairs]{};   // longrope: [R/2] inv_freq[i] = theta^(-2i/R) / shortFactors[i]
    float longFactors[kMaxRotaryPairs]{};    // longrope: [R/2] the same past original_max_positions
};

// Host: RopeConfig -> RopeParams (inverse frequencies in double, rounded once to float).
// Returns false for an invalid config (odd or oversized rotary dim, non-positive theta/factor), with the
// reason in lastErrorMessage().
bool computeRopeParams(RopeConfig const& cfg, int32_t headDim, RopeParams& out);

// The C API takes this struct as it is (plugins/capi): it stays a standard-layout POD, and a member added here
// needs its entry in capi/capi_structs.cpp (the build fails until it has one).
struct QKVWriteParams {
    // ---- shapes
    int32_t numQHeads;   // H
    int32_t numKVHeads;  // KVH (H % KVH == 0)
    int32_t headDim;     // D, one of kSupportedHeadDims (capabilities.h)
    IODType ioDType;
    // ---- inputs
    void const* qkv;   // [T, (H + 2*KVH) * D]
    void const* bias;  // [(H + 2*KVH) * D] or nullptr
    int32_t const* positionIds;  // [T] explicit RoPE positions, or nullptr -> pastLens[b] + i
    StepMetadata meta;
    // ---- pool
    KVLayout layout;
    CacheDType cacheDType;
    int32_t layer;     // layer within the pool group
    float kScale;      // quantized caches: stored = x / kScale
    float vScale;
    // ---- RoPE
    RopeParams rope;
    // ---- outputs
    void* qOut;        // [T, H * D]
    bool qOutFP8;      // store q as fp8 e4m3 (q / qScale)
    float qScale;
    bool zeroVTail;    // after the write, zero the V rows past the sequence's end in its last page
    int32_t* status;   // [kStatusFields]
};

// Validates the parameters that the host can check (head dims, dtypes, heads divisibility, layout vs
// counts, pointer presence) and launches one kernel on `stream`. Never syncs. Returns cudaErrorInvalidValue
// with a message through lastErrorMessage() on invalid parameters.
cudaError_t launchQKVWrite(QKVWriteParams const& params, cudaStream_t stream);

}  // namespace pagedkv
