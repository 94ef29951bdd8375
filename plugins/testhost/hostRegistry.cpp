#include "hostRegistry.h"

#include <dlfcn.h>

#include "pluginLibrary.h"

namespace testhost {

namespace {
std::string key(std::string const& name, std::string const& version, std::string const& ns) {
    return name + "/" + version + "/" + ns;
}
}  // namespace

HostPluginRegistry& HostPluginRegistry::instance() {
    static HostPluginRegistry* registry = new HostPluginRegistry();  // never destroyed: libraries may outlive main
    return *registry;
}

bool HostPluginRegistry::symbolVisible() {
    return dlsym(RTLD_DEFAULT, "getPluginRegistry") == reinterpret_cast<void*>(&::getPluginRegistry);
}

bool HostPluginRegistry::registerCreator(nvinfer1::IPluginCreatorInterface& creator,
                                         char const* const pluginNamespace) noexcept {
    auto* v3 = asCreatorV3One(&creator);
    std::string const ns = pluginNamespace ? pluginNamespace : "";
    if (v3 == nullptr) {
        mEvents.push_back("register (not a IPluginCreatorV3One): refused");
        return false;
    }
    std::string const k = key(v3->getPluginName(), v3->getPluginVersion(), ns);
    for (Entry const& e : mEntries) {
        if (key(e.name, e.version, e.pluginNamespace) == k) {
            mEvents.push_back("register " + k + ": refused (already registered)");
            return false;
        }
    }
    mEntries.push_back(Entry{&creator, v3->getPluginName(), v3->getPluginVersion(), ns});
    mEvents.push_back("register " + k + ": ok");
    return true;
}

nvinfer1::IPluginCreatorInterface* const* HostPluginRegistry::getAllCreators(int32_t* const numCreators) const noexcept {
    mCreatorList.clear();
    for (Entry const& e : mEntries) mCreatorList.push_back(e.creator);
    *numCreators = static_cast<int32_t>(mCreatorList.size());
    return mCreatorList.empty() ? nullptr : mCreatorList.data();
}

nvinfer1::IPluginCreatorInterface* HostPluginRegistry::getCreator(char const* const pluginName,
                                                                  char const* const pluginVersion,
                                                                  char const* const pluginNamespace) noexcept {
    std::string const k = key(pluginName ? pluginName : "", pluginVersion ? pluginVersion : "",
                              pluginNamespace ? pluginNamespace : "");
    for (Entry const& e : mEntries) {
        if (key(e.name, e.version, e.pluginNamespace) == k) return e.creator;
    }
    return nullptr;
}

bool HostPluginRegistry::deregisterCreator(nvinfer1::IPluginCreatorInterface const& creator) noexcept {
    for (auto it = mEntries.begin(); it != mEntries.end(); ++it) {
        if (it->creator == &creator) {
            mEvents.push_back("deregister " + key(it->name, it->version, it->pluginNamespace) + ": ok");
            mEntries.erase(it);
            return true;
        }
    }
    mEvents.push_back("deregister (unknown creator): not found");
    return false;
}

nvinfer1::IPluginRegistry::PluginLibraryHandle HostPluginRegistry::loadLibrary(char const* pluginPath) noexcept {
    // What IPluginRegistry::loadLibrary does: dlopen, hand over a logger finder, take the creators, register
    // each under its own namespace; any refusal fails the whole load.
    mEvents.push_back(std::string("loadLibrary ") + pluginPath);
    void* handle = dlopen(pluginPath, RTLD_LAZY | RTLD_LOCAL);
    if (handle == nullptr) {
        mEvents.push_back(std::string("loadLibrary: dlopen failed: ") + dlerror());
        return nullptr;
    }
    if (auto setFinder = reinterpret_cast<SetLoggerFinderFn>(dlsym(handle, "setLoggerFinder"))) {
        setFinder(&hostLoggerFinder());
    }
    auto getCreators = reinterpret_cast<GetCreatorsFn>(dlsym(handle, "getCreators"));
    if (getCreators == nullptr) {
        mEvents.push_back("loadLibrary: no getCreators symbol");
        return nullptr;
    }
    int32_t n = 0;
    nvinfer1::IPluginCreatorInterface* const* creators = getCreators(n);
    bool ok = true;
    for (int32_t i = 0; i < n; ++i) {
        auto* v3 = asCreatorV3One(creators[i]);
        ok = registerCreator(*creators[i], v3 ? v3->getPluginNamespace() : "") && ok;
    }
    mEvents.push_back(std::string("loadLibrary: ") + (ok ? "ok" : "failed"));
    return ok ? handle : nullptr;
}

void HostPluginRegistry::deregisterLibrary(PluginLibraryHandle) noexcept {}

nvinfer1::IPluginCreatorInterface* const* HostPluginRegistry::getAllCreatorsRecursive(int32_t* const numCreators) noexcept {
    return getAllCreators(numCreators);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
bool HostPluginRegistry::registerCreator(nvinfer1::IPluginCreator&, char const* const) noexcept {
    mEvents.push_back("register (IPluginCreator V2 overload): refused");
    return false;
}

nvinfer1::IPluginCreator* const* HostPluginRegistry::getPluginCreatorList(int32_t* const numCreators) const noexcept {
    *numCreators = 0;
    return nullptr;
}

nvinfer1::IPluginCreator* HostPluginRegistry::getPluginCreator(char const* const, char const* const,
                                                               char const* const) noexcept {
    return nullptr;
}

bool HostPluginRegistry::deregisterCreator(nvinfer1::IPluginCreator const&) noexcept { return false; }
#pragma GCC diagnostic pop
void HostPluginRegistry::setErrorRecorder(nvinfer1::IErrorRecorder* const) noexcept {}
nvinfer1::IErrorRecorder* HostPluginRegistry::getErrorRecorder() const noexcept { return nullptr; }
nvinfer1::IPluginResource* HostPluginRegistry::acquirePluginResource(char const*, nvinfer1::IPluginResource*) noexcept {
    return nullptr;
}
int32_t HostPluginRegistry::releasePluginResource(char const*) noexcept { return -1; }

}  // namespace testhost

extern "C" nvinfer1::IPluginRegistry* getPluginRegistry() noexcept {
    testhost::HostPluginRegistry& registry = testhost::HostPluginRegistry::instance();
    return registry.enabled() ? &registry : nullptr;
}

extern "C" int32_t getInferLibMajorVersion() noexcept {
    return testhost::HostPluginRegistry::instance().apiMajorVersion();
}

// NV_TENSORRT_VERSION's encoding (major * 10000 + minor * 100 + patch) for the reported major.
extern "C" int32_t getInferLibVersion() noexcept {
    return testhost::HostPluginRegistry::instance().apiMajorVersion() * 10000;
}
