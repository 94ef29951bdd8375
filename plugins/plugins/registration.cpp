// The plugin library's entry points, for the three ways a process loads it (docs/plugin_io.md "Loading the library"):
//
// 1. IPluginRegistry::loadLibrary / trtexec --dynamicPlugins / version-compatible engines: TensorRT dlopens the
//    library, calls setLoggerFinder and getCreators, and registers each creator itself.
// 2. trtexec --staticPlugins, polygraphy --plugins, ctypes.CDLL: a plain dlopen. The creators must register
//    themselves at load time. The library does not link libnvinfer (-Wl,--no-undefined), so the static
//    initializer below looks for getPluginRegistry in the libnvinfer the process already loaded, and does
//    nothing (without failing) when there is none.
// 3. Both: loadLibrary dlopens the library (1), so the static initializer has already registered the creators
//    when getCreators is called, and loadLibrary fails when a creator is registered twice. getCreators
//    therefore withdraws the load-time registrations first: whoever asks for the creators registers them.
#include <NvInferRuntime.h>
#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "attentionPlugin/attentionPlugin.h"
#include "common/pluginLogging.h"
#include "common/pluginNames.h"
#include "qkvWritePlugin/qkvWritePlugin.h"

namespace pagedkv {
namespace plugin {
namespace {

using nvinfer1::IPluginCreatorInterface;
using nvinfer1::IPluginCreatorV3One;
using nvinfer1::IPluginRegistry;

constexpr int32_t kNumCreators = 2;

// Function-local statics: constructed on first use, whichever entry point (static initializer or getCreators)
// comes first, and destroyed after the LoadTimeRegistration below (constructed while it was being built).
IPluginCreatorInterface* const* creatorList() {
    static QKVWritePluginCreator writeCreator;
    static AttentionPluginCreator attentionCreator;
    static IPluginCreatorInterface* const creators[kNumCreators] = {&writeCreator, &attentionCreator};
    return creators;
}

using GetPluginRegistryFn = IPluginRegistry* (*)();

// The registry of a libnvinfer the process has already loaded, or nullptr. Never loads libnvinfer itself.
IPluginRegistry* findLoadedRegistry() {
    // Global scope first: an application linked against libnvinfer, or a test host that exports its own.
    void* symbol = dlsym(RTLD_DEFAULT, "getPluginRegistry");
    if (symbol == nullptr) {
        // The tensorrt Python module loads libnvinfer into a local scope, invisible to RTLD_DEFAULT:
        // ask for it by name without loading it.
        for (char const* soname : {"libnvinfer.so.10", "libnvinfer.so.11", "libnvinfer.so"}) {
            void* handle = dlopen(soname, RTLD_NOLOAD | RTLD_LAZY | RTLD_LOCAL);
            if (handle == nullptr) continue;
            symbol = dlsym(handle, "getPluginRegistry");
            dlclose(handle);  // drops only the reference RTLD_NOLOAD added
            if (symbol != nullptr) break;
        }
    }
    return symbol != nullptr ? reinterpret_cast<GetPluginRegistryFn>(symbol)() : nullptr;
}

class LoadTimeRegistration {
public:
    LoadTimeRegistration() noexcept {
        try {
            IPluginRegistry* registry = findLoadedRegistry();
            if (registry == nullptr) return;  // no TensorRT in the process yet: getCreators serves later loaders
            IPluginCreatorInterface* const* creators = creatorList();
            for (int32_t i = 0; i < kNumCreators; ++i) {
                auto* creator = static_cast<IPluginCreatorV3One*>(creators[i]);
                // Another copy of the library (or an earlier loadLibrary) may own the name already.
                if (registry->getCreator(creator->getPluginName(), creator->getPluginVersion(), kPluginNamespace)) {
                    continue;
                }
                if (registry->registerCreator(*creator, kPluginNamespace)) {
                    mRegistered.push_back(creator);
                } else {
                    logWarning(std::string("load-time registration of ") + creator->getPluginName() + " v" +
                               creator->getPluginVersion() + " in namespace '" + kPluginNamespace + "' was refused");
                }
            }
            if (!mRegistered.empty()) mRegistry = registry;
        } catch (...) {
            // A static initializer must not throw out of dlopen; the library stays usable through getCreators.
            logWarning("load-time registration failed; loaders that call getCreators still get the creators");
        }
    }

    ~LoadTimeRegistration() { withdraw(); }  // the registry must not keep creators of an unloaded library

    // Deregisters what the load-time registration added; the caller of getCreators registers them instead.
    void withdraw() noexcept {
        std::lock_guard<std::mutex> lock(mMutex);
        if (mRegistry == nullptr) return;
        for (IPluginCreatorInterface* creator : mRegistered) mRegistry->deregisterCreator(*creator);
        mRegistered.clear();
        mRegistry = nullptr;
    }

private:
    std::mutex mMutex;
    IPluginRegistry* mRegistry = nullptr;
    std::vector<IPluginCreatorInterface*> mRegistered;
};

LoadTimeRegistration gLoadTimeRegistration;

}  // namespace
}  // namespace plugin
}  // namespace pagedkv

extern "C" {

__attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    pagedkv::plugin::gLoadTimeRegistration.withdraw();
    nbCreators = pagedkv::plugin::kNumCreators;
    return pagedkv::plugin::creatorList();
}

__attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
    pagedkv::plugin::setLoggerFinder(finder);
}

}  // extern "C"
