#include "launch_common.h"

#include <mutex>
#include <vector>

#include "pagedkv/qkv_write.h"  // lastErrorMessage() declaration

namespace pagedkv {
namespace {
thread_local std::string tLastError;
}

cudaError_t invalidArgument(std::string msg) {
    tLastError = std::move(msg);
    return cudaErrorInvalidValue;
}

cudaError_t recordError(cudaError_t err, std::string const& what) {
    if (err != cudaSuccess) tLastError = what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
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
