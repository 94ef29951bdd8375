// Launcher-side helpers shared by every pagedkv launcher: the thread-local error message behind
// lastErrorMessage(), CUDA error checks, the SM count cache. Kernels never include this.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace pagedkv {

// Records `msg` as the reason of the failure and returns cudaErrorInvalidValue.
cudaError_t invalidArgument(std::string msg);

// Records `what` plus CUDA's own name for `err` as the reason and returns `err` (cudaSuccess passes through
// without touching the message). For failures of CUDA calls inside launchers (launch config, attributes).
cudaError_t recordError(cudaError_t err, std::string const& what);

// Multiprocessor count of the current device (cached per device).
int smCountOfCurrentDevice();

}  // namespace pagedkv

// Validation helper for launchers: `PKV_REQUIRE(cond, "field", value, "expected ...")`.
#define PKV_REQUIRE(cond, field, value, expected)                                                     \
    do {                                                                                              \
        if (!(cond))                                                                                  \
            return ::pagedkv::invalidArgument(std::string(field) + "=" + std::to_string(value) +      \
                                              ": expected " + (expected));                            \
    } while (0)
