#include "common/loadedTensorRT.h"

#include <dlfcn.h>

namespace pagedkv {
namespace plugin {
namespace {

// Sonames of the libraries that export getPluginRegistry, newest first within each flavour.
constexpr char const* kTensorRTSonames[] = {"libnvinfer.so.10", "libnvinfer.so.11", "libnvinfer.so",
                                           "libtensorrt_rtx.so.1", "libtensorrt_rtx.so"};

// `name` from `handle`, only when it lives in the object whose base address is `base`.
void* symbolOf(void* handle, void const* base, char const* name) {
    void* symbol = dlsym(handle, name);
    Dl_info info{};
    if (symbol == nullptr || dladdr(symbol, &info) == 0 || info.dli_fbase != base) return nullptr;
    return symbol;
}

}  // namespace

LoadedTensorRT LoadedTensorRT::find() noexcept {
    LoadedTensorRT found;
    try {
        auto take = [&found](void* handle) {
            void* anchor = dlsym(handle, "getPluginRegistry");
            Dl_info info{};
            if (anchor == nullptr || dladdr(anchor, &info) == 0) return false;
            found.mPath = info.dli_fname != nullptr ? info.dli_fname : "";
            found.mGetPluginRegistry = reinterpret_cast<RegistryFn>(anchor);
            found.mGetMajorVersion =
                reinterpret_cast<VersionFn>(symbolOf(handle, info.dli_fbase, "getInferLibMajorVersion"));
            found.mGetVersion = reinterpret_cast<VersionFn>(symbolOf(handle, info.dli_fbase, "getInferLibVersion"));
            return true;
        };
        if (take(RTLD_DEFAULT)) return found;
        for (char const* soname : kTensorRTSonames) {
            void* handle = dlopen(soname, RTLD_NOLOAD | RTLD_LAZY | RTLD_LOCAL);
            if (handle == nullptr) continue;
            bool const ok = take(handle);
            // Drops only the reference RTLD_NOLOAD added; the process keeps the library loaded.
            dlclose(handle);
            if (ok) return found;
        }
    } catch (...) {
        // (std::string allocation) nothing found
    }
    return LoadedTensorRT{};
}

int32_t LoadedTensorRT::majorVersion() const { return mGetMajorVersion != nullptr ? mGetMajorVersion() : -1; }

int32_t LoadedTensorRT::version() const { return mGetVersion != nullptr ? mGetVersion() : -1; }

bool LoadedTensorRT::apiMatchesHeaders() const { return found() && majorVersion() == NV_TENSORRT_MAJOR; }

std::string LoadedTensorRT::describe() const {
    std::string const file = mPath.substr(mPath.rfind('/') == std::string::npos ? 0 : mPath.rfind('/') + 1);
    return file + " (version " + std::to_string(version()) + ", API major " + std::to_string(majorVersion()) + ")";
}

nvinfer1::IPluginRegistry* LoadedTensorRT::pluginRegistry() const {
    return mGetPluginRegistry != nullptr ? mGetPluginRegistry() : nullptr;
}

}  // namespace plugin
}  // namespace pagedkv
