#include "launch_common.h"

#include <mutex>
#include <vector>

#include "pagedkv/last_error.h"

namespace pagedkv {
namespace {
thread_local std::string tLastError;
}

void clearLastError() { tLastError.clear(); }

cudaError_t invalidArgument(std::string msg) {
    tLastError = std::move(msg);
    return cudaErrorInvalidValue;
}

cudaError_t invalidField(FieldIssue const& issue) { return invalidArgument(issue.message()); }

cudaError_t recordCudaError(cudaError_t err, char const* where) {
    if (err != cudaSuccess && tLastError.empty())
        tLastError = std::string(where) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
    return err;
}

char const* lastErrorMessage() { return tLastError.c_str(); }

int smCountOfCurrentDevice() {
    static std::mutex mutex;
    static std::vector<int> counts;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return 1;
    std::lock_guard<std::mutex> lock(mutex);
    if (device >= static_cast<int>(counts.size())) counts.resize(device + 1, 0);
    if (counts[device] == 0) {
        int n = 0;
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
        counts[device] = n > 0 ? n : 1;
    }
    return counts[device];
}

}  // namespace pagedkv
