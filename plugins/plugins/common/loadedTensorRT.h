// The TensorRT library this process has already loaded — libnvinfer (TensorRT 10/11) or libtensorrt_rtx
// (TensorRT-RTX) — found without ever loading one: the plugin libraries never link TensorRT.
//
// Where to look: dlsym(RTLD_DEFAULT) first (an application linked against TensorRT, or the test host, which
// exports the same symbols), then a dlopen(RTLD_NOLOAD) handle of each known soname (the Python modules load
// TensorRT into a local scope that RTLD_DEFAULT does not see). Every symbol is taken from the object that exports
// getPluginRegistry, so an unrelated library's function of the same name is never called.
//
// ABI: the C functions found here are safe to call whatever the library's version. The IPluginRegistry that
// getPluginRegistry returns is a C++ interface laid out by the library's own headers, and its table changed
// between TensorRT 10 and TensorRT-RTX / TensorRT 11 (the IPluginCreator overloads went): call it only when
// apiMatchesHeaders() (measured: TensorRT-RTX 1.7.1 crashes on a getCreator call through TensorRT 10.14's layout).
// The library's global logger (getLogger) is not used: TensorRT-RTX 1.7.1's drops what it is given.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>

namespace pagedkv {
namespace plugin {

class LoadedTensorRT {
public:
    // The loaded library, or one whose found() is false. Never loads anything, never throws.
    static LoadedTensorRT find() noexcept;

    bool found() const { return mGetPluginRegistry != nullptr; }
    std::string const& path() const { return mPath; }  // the file that exports the symbols (dladdr)
    // getInferLibMajorVersion() / getInferLibVersion() (TensorRT-RTX 1.7.1: 1 / 10701), -1 when not exported.
    int32_t majorVersion() const;
    int32_t version() const;
    // The library's API major equals the headers this library was compiled against (NV_TENSORRT_MAJOR): only
    // then may its IPluginRegistry be called.
    bool apiMatchesHeaders() const;
    // "libtensorrt_rtx.so.1 (version 10701, API major 1)" for messages.
    std::string describe() const;

    nvinfer1::IPluginRegistry* pluginRegistry() const;  // nullptr when not found

private:
    using RegistryFn = nvinfer1::IPluginRegistry* (*)() noexcept;
    using VersionFn = int32_t (*)() noexcept;

    std::string mPath;
    RegistryFn mGetPluginRegistry = nullptr;
    VersionFn mGetMajorVersion = nullptr;
    VersionFn mGetVersion = nullptr;
};

}  // namespace plugin
}  // namespace pagedkv
