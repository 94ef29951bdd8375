#include "common/pluginErrors.h"

#include "pagedkv/last_error.h"

namespace pagedkv {
namespace plugin {

void checkLaunch(char const* launcher, cudaError_t err) {
    if (err == cudaSuccess) return;
    std::string const reason = lastErrorMessage();  // this launch's own (launchers clear it first)
    throw PluginError(std::string(launcher) + ": " + cudaGetErrorName(err) + (reason.empty() ? "" : ": " + reason));
}

}  // namespace plugin
}  // namespace pagedkv
