// Loading the plugin library the way IPluginRegistry::loadLibrary does (dlopen, setLoggerFinder,
// getCreators), the host's logger that records every message the library sends, and the interface-kind checks
// TensorRT makes before it casts a creator or a capability.
#pragma once

#include <NvInferRuntime.h>

#include <string>
#include <vector>

#include "json.h"

namespace testhost {

using GetCreatorsFn = nvinfer1::IPluginCreatorInterface* const* (*)(int32_t&);
using SetLoggerFinderFn = void (*)(nvinfer1::ILoggerFinder*);

// Records messages; reports take them out with drain() after each step so each step shows its own.
class HostLogger final : public nvinfer1::ILogger {
public:
    void log(Severity severity, char const* msg) noexcept override;
    Json drain();  // [{"severity": "ERROR", "message": "..."}], then clears
private:
    std::vector<std::pair<Severity, std::string>> mMessages;
};

// Answers with the host logger, or — setAnswers(false) — with nullptr, as TensorRT's finder does when the
// caller is not a builder, runtime or refitter (the ONNX parser creating a plugin).
class HostLoggerFinder final : public nvinfer1::ILoggerFinder {
public:
    nvinfer1::ILogger* findLogger() override { return mAnswers ? &mLogger : nullptr; }
    HostLogger& logger() { return mLogger; }
    void setAnswers(bool answers) { mAnswers = answers; }
private:
    HostLogger mLogger;
    bool mAnswers = true;
};

HostLoggerFinder& hostLoggerFinder();

// The creator as an IPluginCreatorV3One when its interface kind says so (as TensorRT checks), else nullptr.
nvinfer1::IPluginCreatorV3One* asCreatorV3One(nvinfer1::IPluginCreatorInterface* creator);
std::string interfaceString(nvinfer1::IVersionedInterface const& iface);  // "PLUGIN_V3ONE_CORE 1.0"

// A dlopen'ed plugin library and its creators.
class PluginLibrary {
public:
    // dlopen(RTLD_LAZY | RTLD_LOCAL), setLoggerFinder(host finder), getCreators. Throws with dlerror().
    explicit PluginLibrary(std::string const& path);
    PluginLibrary(PluginLibrary const&) = delete;
    PluginLibrary& operator=(PluginLibrary const&) = delete;

    std::vector<nvinfer1::IPluginCreatorInterface*> const& creators() const { return mCreators; }
    // The creator named `name` (any version), as IPluginCreatorV3One. Throws when absent.
    nvinfer1::IPluginCreatorV3One* creator(std::string const& name) const;
    void* handle() const { return mHandle; }

private:
    void* mHandle = nullptr;
    std::vector<nvinfer1::IPluginCreatorInterface*> mCreators;
};

}  // namespace testhost
