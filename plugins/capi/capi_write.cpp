// C API of the fused QKV write: the launcher on the caller's QKVWriteParams (all validation is the launcher's,
// qkv_write.cu), the RoPE table of a RopeConfig (computeRopeParams, as the plugin precomputes it) and the
// kernel's angle reduction run on the host.
#include "capi_write.h"

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

}  // extern "C"
