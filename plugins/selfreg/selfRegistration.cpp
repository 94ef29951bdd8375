// libpagedkv_plugins_selfreg.so: the plugin creators for loaders that only dlopen a library (trtexec
// --staticPlugins, polygraphy --plugins, ctypes.CDLL). Loading it loads libpagedkv_plugins.so (a DT_NEEDED
// dependency found through $ORIGIN) and registers that library's creators, under namespace "pagedkv", with the
// TensorRT library the process has already loaded (common/loadedTensorRT.h); unloading it deregisters them.
// Loaders that call getCreators themselves (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins,
// version-compatible engines) take libpagedkv_plugins.so instead: load one or the other in a process, not both
// (the second registration of a name fails, as TensorRT's registry refuses duplicates).
//
// It registers only when the loaded library's API major version equals the headers' (NV_TENSORRT_MAJOR): the
// IPluginRegistry calls go through the headers' virtual table, which TensorRT-RTX and TensorRT 11 lay out
// differently. Otherwise, and when no TensorRT is loaded yet, it registers nothing and says so through that
// library's logger; IPluginRegistry::loadLibrary on libpagedkv_plugins.so works with every flavour.
#include <NvInferRuntime.h>

#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "common/loadedTensorRT.h"
#include "common/pluginLogging.h"
#include "common/pluginNames.h"

// libpagedkv_plugins.so's entry point (linked: the dynamic loader resolves it before this library initializes).
extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

namespace pagedkv {
namespace plugin {
namespace {

class SelfRegistration {
public:
    SelfRegistration() noexcept {
        try {
            register_();
        } catch (std::exception const& e) {  // a static initializer must not throw out of dlopen
            logWarning(std::string("self-registration failed: ") + e.what());
        }
    }

    ~SelfRegistration() {  // the registry must not keep creators of an unloaded library
        std::lock_guard<std::mutex> lock(mMutex);
        for (nvinfer1::IPluginCreatorInterface* creator : mRegistered) mRegistry->deregisterCreator(*creator);
    }

private:
    void register_() {
        LoadedTensorRT const trt = LoadedTensorRT::find();
        if (!trt.found()) return;  // nothing to register with; the process loads TensorRT later, or never
        if (!trt.apiMatchesHeaders()) {
            logWarning("libpagedkv_plugins_selfreg.so registers no creators with " + trt.describe() +
                       ": its IPluginRegistry is not the TensorRT " + std::to_string(NV_TENSORRT_MAJOR) +
                       " interface this library was built against; load libpagedkv_plugins.so with "
                       "IPluginRegistry::loadLibrary (Python: get_plugin_registry().load_library(path)) instead");
            return;
        }
        nvinfer1::IPluginRegistry* registry = trt.pluginRegistry();
        if (registry == nullptr) return;
        int32_t n = 0;
        nvinfer1::IPluginCreatorInterface* const* creators = getCreators(n);
        std::lock_guard<std::mutex> lock(mMutex);
        for (int32_t i = 0; i < n; ++i) {
            auto* creator = static_cast<nvinfer1::IPluginCreatorV3One*>(creators[i]);
            // Another copy of the library (or an earlier loadLibrary) may own the name already: not ours to replace.
            if (registry->getCreator(creator->getPluginName(), creator->getPluginVersion(), kPluginNamespace)) {
                continue;
            }
            if (registry->registerCreator(*creators[i], kPluginNamespace)) {
                mRegistered.push_back(creators[i]);
            } else {
                logWarning(std::string("registration of ") + creator->getPluginName() + " v" +
                           creator->getPluginVersion() + " in namespace '" + kPluginNamespace + "' was refused");
            }
        }
        mRegistry = registry;
    }

    std::mutex mMutex;
    nvinfer1::IPluginRegistry* mRegistry = nullptr;
    std::vector<nvinfer1::IPluginCreatorInterface*> mRegistered;
};

SelfRegistration gSelfRegistration;

}  // namespace
}  // namespace plugin
}  // namespace pagedkv
