#include "common/pluginErrors.h"

#include "pagedkv/qkv_write.h"  // lastErrorMessage

namespace pagedkv {
namespace plugin {

void checkLaunch(char const* launcher, cudaError_t err) {
    if (err == cudaSuccess) return;
    throw PluginError(std::string(launcher) + ": " + cudaGetErrorName(err) +
                      (err == cudaErrorInvalidValue ? std::string(": ") + lastErrorMessage() : std::string()));
}

}  // namespace plugin
}  // namespace pagedkv
