// Error handling shared by every plugin method. TensorRT calls plugins through noexcept virtuals, so each
// method runs its body inside `guarded`, which turns an exception into a logged message naming the plugin and
// the method, and into the method's failure value (nullptr, -1, false). Validation code simply throws
// PluginError with a message that names the field or tensor and the offending value.
#pragma once

#include <cuda_runtime_api.h>

#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

#include "common/pluginLogging.h"

namespace pagedkv {
namespace plugin {

class PluginError : public std::runtime_error {
public:
    explicit PluginError(std::string const& message) : std::runtime_error(message) {}
};

// Runs `body` and returns its result; on an exception logs "<plugin>::<method>: <reason>" and returns
// `onError`. `plugin` and `method` are string literals (never freed).
template <typename Result, typename Body>
Result guarded(char const* plugin, char const* method, Result onError, Body&& body) noexcept {
    try {
        return std::forward<Body>(body)();
    } catch (std::exception const& e) {
        logError(std::string(plugin) + "::" + method + ": " + e.what());
    } catch (...) {
        logError(std::string(plugin) + "::" + method + ": unknown exception");
    }
    return onError;
}

// enqueue: a launcher's (launchQKVWrite, launchAttention) failure as a PluginError "<launcher>: <CUDA error>:
// <the launcher's own reason>" (lastErrorMessage: the rejected field, or the failing CUDA call). cudaSuccess: no-op.
void checkLaunch(char const* launcher, cudaError_t err);

}  // namespace plugin
}  // namespace pagedkv
