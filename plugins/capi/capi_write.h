// pagedkv C API: the fused QKV-preprocess + paged KV write (pagedkv/qkv_write.h) for ctypes callers. The caller
// fills the launcher's own QKVWriteParams (its layout from pagedkv_kv_layout, its RoPE table from
// pagedkv_rope_params); src/pagedkv/kernels/write.py does.
//
//   T tokens, B sequences, MB block-table width, H query heads, KVH KV heads, D head_dim
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "pagedkv/qkv_write.h"
#include "pagedkv_capi.h"

extern "C" {

// pagedkv::launchQKVWrite on `stream`: validates (errors name the field and the value; no CUDA call before
// that) and launches. Never synchronizes.
PAGEDKV_EXPORT int32_t pagedkv_qkv_write(const pagedkv::QKVWriteParams* params, cudaStream_t stream);

// The same with the kernel's walk forced: its warps in groups of `group_warps` (0 auto, 1, 2, 4 or 8; see
// launchQKVWrite): the tests run every walk on every configuration, the benchmark compares them.
PAGEDKV_EXPORT int32_t pagedkv_qkv_write_grouped(const pagedkv::QKVWriteParams* params, int32_t group_warps,
                                                 cudaStream_t stream);

// Host replay of that walk (replayQKVWriteSchedule, no CUDA): for params' shape (num_tokens, heads, head_dim;
// nothing else is read), `group_warps` and `resident_warps` resident warps, visits[t * P + pass] counts the visits
// of each pair (int32[T * P], P passes per token) and summary = int64[5] {warps, group warps, token entries,
// record chunks, pairs visited}.
PAGEDKV_EXPORT int32_t pagedkv_qkv_write_schedule_check(const pagedkv::QKVWriteParams* params, int32_t group_warps,
                                                        int64_t resident_warps, int32_t* visits, int64_t* summary);

// computeRopeParams: the RoPE table of `config` for heads of `head_dim` (what the plugin precomputes).
PAGEDKV_EXPORT int32_t pagedkv_rope_params(const pagedkv::RopeConfig* config, int32_t head_dim,
                                           pagedkv::RopeParams* out);

// The kernel's RoPE angle reduction evaluated on the host (same code): angle of positions[i] for inverse
// frequency inv_freq[j], in [-pi, pi), into out[i * num_freqs + j].
PAGEDKV_EXPORT int32_t pagedkv_rope_angles(const float* inv_freq, int32_t num_freqs, const int32_t* positions,
                                           int32_t n, float* out);

}  // extern "C"
