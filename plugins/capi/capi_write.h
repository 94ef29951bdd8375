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

// computeRopeParams: the RoPE table of `config` for heads of `head_dim` (what the plugin precomputes).
PAGEDKV_EXPORT int32_t pagedkv_rope_params(const pagedkv::RopeConfig* config, int32_t head_dim,
                                           pagedkv::RopeParams* out);

// The kernel's RoPE angle reduction evaluated on the host (same code): angle of positions[i] for inverse
// frequency inv_freq[j], in [-pi, pi), into out[i * num_freqs + j].
PAGEDKV_EXPORT int32_t pagedkv_rope_angles(const float* inv_freq, int32_t num_freqs, const int32_t* positions,
                                           int32_t n, float* out);

// The launcher's work decomposition (qkvWriteWarps) on the host: into *out, how many warps share the
// num_tokens x passes_per_token (token, pass) pairs when `resident_warps` warps fit the GPU at once.
PAGEDKV_EXPORT int32_t pagedkv_qkv_write_warps(int32_t num_tokens, int32_t passes_per_token, int64_t resident_warps,
                                               int32_t* out);

}  // extern "C"
