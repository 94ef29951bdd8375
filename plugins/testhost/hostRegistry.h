// The test host's stand-in for the TensorRT library of a process: the C entry points libnvinfer and
// libtensorrt_rtx export (getPluginRegistry, getInferLibMajorVersion, getInferLibVersion), so that
// the plugin libraries find the host exactly as they find TensorRT (plugins/plugins/common/loadedTensorRT.h).
// Its IPluginRegistry follows TensorRT's rules: a (name, version, namespace) registers once; loadLibrary dlopens
// the library, calls setLoggerFinder and getCreators, registers every creator, and fails if any registration
// fails. The executable must export the symbols (plugins/CMakeLists.txt); symbolVisible() says if it does.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace testhost {

class HostPluginRegistry final : public nvinfer1::IPluginRegistry {
public:
    struct Entry {
        nvinfer1::IPluginCreatorInterface* creator;
        std::string name;
        std::string version;
        std::string pluginNamespace;
    };

    static HostPluginRegistry& instance();
    // getPluginRegistry() returns this registry only while enabled; disabled, it returns nullptr (the
    // "no TensorRT registry in the process" case the library must survive).
    void setEnabled(bool enabled) { mEnabled = enabled; }
    bool enabled() const { return mEnabled; }
    // What getInferLibMajorVersion() answers (default: the headers' NV_TENSORRT_MAJOR; TensorRT-RTX says 1).
    void setApiMajorVersion(int32_t major) { mApiMajorVersion = major; }
    int32_t apiMajorVersion() const { return mApiMajorVersion; }
    // Does dlsym(RTLD_DEFAULT, "getPluginRegistry") find the host's function?
    static bool symbolVisible();

    std::vector<Entry> const& entries() const { return mEntries; }
    std::vector<std::string> const& events() const { return mEvents; }  // "register PagedKVQKVWrite/1/pagedkv: ok"

    // ---- IPluginRegistry (the V3 surface; the deprecated V2 overloads refuse)
    bool registerCreator(nvinfer1::IPluginCreatorInterface& creator, char const* const pluginNamespace) noexcept override;
    nvinfer1::IPluginCreatorInterface* const* getAllCreators(int32_t* const numCreators) const noexcept override;
    nvinfer1::IPluginCreatorInterface* getCreator(char const* const pluginName, char const* const pluginVersion,
                                                  char const* const pluginNamespace = "") noexcept override;
    bool deregisterCreator(nvinfer1::IPluginCreatorInterface const& creator) noexcept override;
    PluginLibraryHandle loadLibrary(char const* pluginPath) noexcept override;
    void deregisterLibrary(PluginLibraryHandle handle) noexcept override;
    nvinfer1::IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const numCreators) noexcept override;

    // The V2 overloads must be overridden (pure virtual) although deprecated.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    bool registerCreator(nvinfer1::IPluginCreator& creator, char const* const pluginNamespace) noexcept override;
    nvinfer1::IPluginCreator* const* getPluginCreatorList(int32_t* const numCreators) const noexcept override;
    nvinfer1::IPluginCreator* getPluginCreator(char const* const pluginName, char const* const pluginVersion,
                                               char const* const pluginNamespace = "") noexcept override;
    bool deregisterCreator(nvinfer1::IPluginCreator const& creator) noexcept override;
#pragma GCC diagnostic pop
    void setErrorRecorder(nvinfer1::IErrorRecorder* const recorder) noexcept override;
    nvinfer1::IErrorRecorder* getErrorRecorder() const noexcept override;
    bool isParentSearchEnabled() const override { return false; }
    void setParentSearchEnabled(bool const) override {}
    nvinfer1::IPluginResource* acquirePluginResource(char const* key, nvinfer1::IPluginResource* resource) noexcept override;
    int32_t releasePluginResource(char const* key) noexcept override;

private:
    HostPluginRegistry() = default;
    ~HostPluginRegistry() noexcept override = default;

    bool mEnabled = false;
    int32_t mApiMajorVersion = NV_TENSORRT_MAJOR;
    std::vector<Entry> mEntries;
    mutable std::vector<nvinfer1::IPluginCreatorInterface*> mCreatorList;
    std::vector<std::string> mEvents;
};

}  // namespace testhost

extern "C" {
__attribute__((visibility("default"))) nvinfer1::IPluginRegistry* getPluginRegistry() noexcept;
__attribute__((visibility("default"))) int32_t getInferLibMajorVersion() noexcept;
__attribute__((visibility("default"))) int32_t getInferLibVersion() noexcept;
}
