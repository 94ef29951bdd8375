// Paged attention over the pool: parameters and launcher (kernels/attention*.cu implement it).
//
//   T tokens, B sequences, H query heads, KVH KV heads, D head_dim
//   q    [T, H * D]  fp16|bf16 (or fp8 e4m3 with qScale), as written by the QKV-write kernel
//   out  [T, H * D]  fp16|bf16 (ioDType)
//   Sequence b's queries are tokens [cuQLens[b], cuQLens[b+1]); query i sits at cache position
//   pastLens[b] + i and sees the cache positions attends(qPos, kvPos, window, attentionSinks) allows
//   (kv_layout.h), reading them in place through the block table: never a gathered copy.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "pagedkv/capabilities.h"  // IODType, the supported head dims
#include "pagedkv/kv_layout.h"
#include "pagedkv/last_error.h"
#include "pagedkv/step_metadata.h"

namespace pagedkv {

// The C API takes this struct as it is (plugins/capi): it stays a standard-layout POD, and a member added here
// needs its entry in capi/capi_structs.cpp (the build fails until it has one).
struct AttentionParams {
    // ---- shapes
    int32_t numQHeads;   // H
    int32_t numKVHeads;  // KVH
    int32_t headDim;     // D, one of kSupportedHeadDims (capabilities.h)
    IODType ioDType;     // dtype of out (and of q unless qFP8)
    bool qFP8;
    float qScale;
    // ---- inputs
    void const* q;       // [T, H * D]
    StepMetadata meta;   // kv length of sequence b after this step's write = pastLens[b] + q_len(b)
    int32_t maxQLen;     // host-known bound on any sequence's new tokens this step (<= T). A sequence with more
                         // new tokens than this is not computed: its rows come out NaN, never stale memory.
    int32_t maxKVLen;    // host-known bound on any sequence's kv length (maxBlocks * pageSize, or the window);
                         // it only sizes the split-K decision: a wrong bound costs balance, never correctness
    // ---- pool
    KVLayout layout;
    CacheDType cacheDType;
    int32_t layer;
    float kScale;        // x = stored * kScale
    float vScale;
    // ---- attention
    int32_t window;      // <= 0: full causal
    int32_t attentionSinks;  // always-visible first positions (with window > 0); not layout.ringSinkTokens
    float softmaxScale;  // usually 1/sqrt(D)
    float logitSoftcap;  // > 0: logits = cap * tanh(logits / cap)
    // ---- outputs
    void* out;           // [T, H * D]
    void* workspace;     // split-K partials, attentionWorkspaceBytes() bytes, or nullptr when that is 0
    size_t workspaceBytes;
};

// Bytes of workspace a launch with these bounds needs (split-K partial outputs and log-sum-exps).
// Depends only on values the host knows at build/enqueue time (shapes, never device data).
size_t attentionWorkspaceBytes(int32_t numTokens, int32_t numSeqs, int32_t numQHeads, int32_t headDim,
                               int32_t maxKVLen, int32_t pageSize);

// Validates, chooses decode / multi-token kernels and the split-K factor (one place), launches on
// `stream`. Never syncs. Invalid parameters -> cudaErrorInvalidValue and lastErrorMessage().
cudaError_t launchAttention(AttentionParams const& params, cudaStream_t stream);

}  // namespace pagedkv
