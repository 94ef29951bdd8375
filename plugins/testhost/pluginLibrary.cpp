#include "pluginLibrary.h"

#include <dlfcn.h>

#include <cstring>
#include <stdexcept>

namespace testhost {

namespace {
char const* severityName(nvinfer1::ILogger::Severity s) {
    using S = nvinfer1::ILogger::Severity;
    switch (s) {
        case S::kINTERNAL_ERROR: return "INTERNAL_ERROR";
        case S::kERROR: return "ERROR";
        case S::kWARNING: return "WARNING";
        case S::kINFO: return "INFO";
        case S::kVERBOSE: return "VERBOSE";
    }
    return "?";
}
}  // namespace

void HostLogger::log(Severity severity, char const* msg) noexcept {
    try {
        mMessages.emplace_back(severity, msg ? msg : "");
    } catch (...) {
    }
}

Json HostLogger::drain() {
    Json out = Json::array();
    for (auto const& m : mMessages) {
        out.push(Json::object().set("severity", severityName(m.first)).set("message", m.second));
    }
    mMessages.clear();
    return out;
}

HostLoggerFinder& hostLoggerFinder() {
    static HostLoggerFinder* finder = new HostLoggerFinder();  // outlives any library that keeps the pointer
    return *finder;
}

nvinfer1::IPluginCreatorV3One* asCreatorV3One(nvinfer1::IPluginCreatorInterface* creator) {
    if (creator == nullptr) return nullptr;
    nvinfer1::InterfaceInfo const info = creator->getInterfaceInfo();
    if (info.kind == nullptr || std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") != 0 || info.major != 1) return nullptr;
    return static_cast<nvinfer1::IPluginCreatorV3One*>(creator);
}

std::string interfaceString(nvinfer1::IVersionedInterface const& iface) {
    nvinfer1::InterfaceInfo const info = iface.getInterfaceInfo();
    return std::string(info.kind ? info.kind : "(null)") + " " + std::to_string(info.major) + "." +
           std::to_string(info.minor);
}

PluginLibrary::PluginLibrary(std::string const& path) {
    mHandle = dlopen(path.c_str(), RTLD_LAZY | RTLD_LOCAL);
    if (mHandle == nullptr) throw std::runtime_error("dlopen(" + path + ") failed: " + dlerror());
    auto setFinder = reinterpret_cast<SetLoggerFinderFn>(dlsym(mHandle, "setLoggerFinder"));
    if (setFinder == nullptr) throw std::runtime_error(path + " does not export setLoggerFinder");
    setFinder(&hostLoggerFinder());
    auto getCreators = reinterpret_cast<GetCreatorsFn>(dlsym(mHandle, "getCreators"));
    if (getCreators == nullptr) throw std::runtime_error(path + " does not export getCreators");
    int32_t n = -1;
    nvinfer1::IPluginCreatorInterface* const* list = getCreators(n);
    if (n < 0 || (n > 0 && list == nullptr)) {
        throw std::runtime_error("getCreators returned " + std::to_string(n) + " creators and list " +
                                 (list ? "non-null" : "null"));
    }
    mCreators.assign(list, list + n);
}

nvinfer1::IPluginCreatorV3One* PluginLibrary::creator(std::string const& name) const {
    for (nvinfer1::IPluginCreatorInterface* c : mCreators) {
        nvinfer1::IPluginCreatorV3One* v3 = asCreatorV3One(c);
        if (v3 != nullptr && name == v3->getPluginName()) return v3;
    }
    throw std::runtime_error("no IPluginCreatorV3One named '" + name + "' in the library");
}

}  // namespace testhost
