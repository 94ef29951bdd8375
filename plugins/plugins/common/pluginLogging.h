// Where the plugin library's messages go: the logger of the TensorRT object that called us (found through the
// ILoggerFinder that IPluginRegistry::loadLibrary / trtexec hand to setLoggerFinder), else stderr.
// A library loaded with a plain dlopen (polygraphy --plugins, trtexec --staticPlugins) never receives a
// finder, so stderr is the normal path there.
#pragma once

#include <NvInferRuntime.h>

#include <string>

namespace pagedkv {
namespace plugin {

using Severity = nvinfer1::ILogger::Severity;

// Stores the finder (thread-safe); nullptr goes back to stderr.
void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;

// Sends `message` to the current logger, or to stderr when there is none. Never throws.
void logMessage(Severity severity, std::string const& message) noexcept;

inline void logError(std::string const& message) noexcept { logMessage(Severity::kERROR, message); }
inline void logWarning(std::string const& message) noexcept { logMessage(Severity::kWARNING, message); }

}  // namespace plugin
}  // namespace pagedkv
