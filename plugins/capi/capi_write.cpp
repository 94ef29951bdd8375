// C API of the fused QKV write: the launcher on the caller's QKVWriteParams (all validation is the launcher's,
// qkv_write.cu), the RoPE table of a RopeConfig (computeRopeParams, as the plugin precomputes it), the
// kernel's angle reduction and the launcher's warp count run on the host.
#include "capi_write.h"

#include <cstdint>

#include "../kernels/launch_common.h"
#include "../kernels/qkv_write_params.cuh"

extern "C" {

int32_t pagedkv_qkv_write(const pagedkv::QKVWriteParams* params, cudaStream_t stream) {
    if (params == nullptr) {
        pagedkv::clearLastError();
        return pagedkv::invalidArgument("params=NULL: expected a QKVWriteParams");
    }
    return pagedkv::launchQKVWrite(*params, stream);
}

int32_t pagedkv_rope_params(const pagedkv::RopeConfig* config, int32_t head_dim, pagedkv::RopeParams* out) {
    pagedkv::clearLastError();
    if (config == nullptr || out == nullptr)
        return pagedkv::invalidArgument("config, out: expected a RopeConfig and a RopeParams, got NULL");
    return pagedkv::computeRopeParams(*config, head_dim, *out) ? 0 : cudaErrorInvalidValue;  // reason recorded
}

int32_t pagedkv_rope_angles(const float* inv_freq, int32_t num_freqs, const int32_t* positions, int32_t n,
                            float* out) {
    pagedkv::clearLastError();
    PKV_REQUIRE(num_freqs >= 0 && n >= 0, "num_freqs", num_freqs, ">= 0 (and n >= 0)");
    PKV_REQUIRE((inv_freq != nullptr || num_freqs == 0) && (positions != nullptr || n == 0) &&
                    (out != nullptr || n * num_freqs == 0),
                "out", reinterpret_cast<uintptr_t>(out), "non-null arrays");
    for (int32_t j = 0; j < num_freqs; ++j) {
        uint64_t const turns = pagedkv::ropeTurnsPerPosition(inv_freq[j]);
        for (int32_t i = 0; i < n; ++i)
            out[static_cast<int64_t>(i) * num_freqs + j] = pagedkv::ropeAngle(positions[i], turns);
    }
    return 0;
}

int32_t pagedkv_qkv_write_warps(int32_t num_tokens, int32_t passes_per_token, int64_t resident_warps, int32_t* out) {
    pagedkv::clearLastError();
    PKV_REQUIRE(num_tokens >= 1, "num_tokens", num_tokens, ">= 1");
    PKV_REQUIRE(passes_per_token >= 1, "passes_per_token", passes_per_token, ">= 1");
    PKV_REQUIRE(resident_warps >= 1 && resident_warps <= INT32_MAX, "resident_warps", resident_warps, "in [1, 2^31)");
    PKV_REQUIRE(out != nullptr, "out", 0, "a pointer");
    *out = pagedkv::qkvWriteWarps(static_cast<int64_t>(num_tokens) * passes_per_token, num_tokens, resident_warps);
    return 0;
}

}  // extern "C"
