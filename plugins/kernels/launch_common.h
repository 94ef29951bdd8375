// Launcher-side helpers shared by every pagedkv launcher: the thread-local reason behind lastErrorMessage()
// (pagedkv/last_error.h), the SM count cache, the spelling of "expected one of ..." lists. Kernels never include
// this.
//
// Every launcher follows one protocol: clearLastError() first, invalidArgument / invalidField for a
// parameter it rejects, recordCudaError around the CUDA work. So a failure always comes with this call's
// reason, never with an earlier call's.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "pagedkv/kv_layout_check.h"  // FieldIssue

namespace pagedkv {

void clearLastError();

// Records `msg` as the reason of the failure and returns cudaErrorInvalidValue.
cudaError_t invalidArgument(std::string msg);

// Records "field=value: expected ..." of a check (kv_layout_check.h) and returns cudaErrorInvalidValue.
cudaError_t invalidField(FieldIssue const& issue);

// Passes `err` through. A CUDA failure that left no reason of this call's own (cleared first) is recorded as
// "<where>: <CUDA error name> (<description>)"; a reason recorded by this call (an invalidArgument deeper down,
// e.g. a kernel the device cannot host) is kept.
cudaError_t recordCudaError(cudaError_t err, char const* where);

// Multiprocessor count of the current device (cached per device).
int smCountOfCurrentDevice();

// "a, b, c": numbers as every "expected one of ..." message lists them (head dims, decode widths).
template <typename Range>
std::string commaList(Range const& values) {
    std::string out;
    for (auto const& v : values) out += (out.empty() ? "" : ", ") + std::to_string(v);
    return out;
}

}  // namespace pagedkv

// Validation helper for launchers: `PKV_REQUIRE(cond, "field", value, "expected ...")`. Fields are named as
// the plugin attributes and the C API name them (snake_case).
#define PKV_REQUIRE(cond, field, value, expected)                                                     \
    do {                                                                                              \
        if (!(cond))                                                                                  \
            return ::pagedkv::invalidArgument(std::string(field) + "=" + std::to_string(value) +      \
                                              ": expected " + (expected));                            \
    } while (0)
