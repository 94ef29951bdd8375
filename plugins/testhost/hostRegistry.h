// The test host's IPluginRegistry, exported as `getPluginRegistry` so that the plugin library's load-time
// self-registration finds it exactly as it finds libnvinfer's (dlsym(RTLD_DEFAULT, "getPluginRegistry")).
// It follows TensorRT's rules: a (name, version, namespace) registers once; loadLibrary dlopens the library,
// calls setLoggerFinder and getCreators, registers every creator, and fails if any registration fails.
// The executable must export the symbol (CMake ENABLE_EXPORTS / -rdynamic); symbolVisible() says if it does.
#pragma once

#include <NvInferRuntime.h>

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
    std::vector<Entry> mEntries;
    mutable std::vector<nvinfer1::IPluginCreatorInterface*> mCreatorList;
    std::vector<std::string> mEvents;
};

}  // namespace testhost

extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginRegistry* getPluginRegistry() noexcept;
