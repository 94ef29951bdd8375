// Where the plugin library's messages go:
//  1. the logger of the TensorRT object calling us, through the ILoggerFinder that IPluginRegistry::loadLibrary /
//     trtexec hand to setLoggerFinder (TensorRT answers for builders, runtimes and refitters);
//  2. otherwise stderr (warnings and errors): a library loaded with a plain dlopen gets no finder, and
//     TensorRT-RTX 1.7.1's finder answers nullptr for every plugin call measured (createPlugin from the ONNX
//     parser, configurePlugin from the builder). The library's global logger (getLogger) is no way out: RTX's
//     drops what it is given.
// Every warning and error is also kept (the last kMaxKeptMessages) for the application, which reads them with
// the exported pagedkv_plugin_messages(): pagedkv's builder puts them into its own error line.
#pragma once

#include <NvInferRuntime.h>

#include <string>

namespace pagedkv {
namespace plugin {

using Severity = nvinfer1::ILogger::Severity;

// Stores the finder (thread-safe); nullptr goes back to stderr.
void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;

// Sends `message` to the first logger above. Never throws.
void logMessage(Severity severity, std::string const& message) noexcept;

inline void logError(std::string const& message) noexcept { logMessage(Severity::kERROR, message); }

constexpr size_t kMaxKeptMessages = 64;
// The kept messages, oldest first, one "SEVERITY: [pagedkv] text" per line, into `buffer` (NUL-terminated,
// truncated to `capacity`); returns the bytes the whole text needs (excluding the NUL). `clear` forgets them.
size_t keptMessages(char* buffer, size_t capacity, bool clear) noexcept;
inline void logWarning(std::string const& message) noexcept { logMessage(Severity::kWARNING, message); }

}  // namespace plugin
}  // namespace pagedkv
