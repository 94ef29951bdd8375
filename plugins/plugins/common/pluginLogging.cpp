#include "common/pluginLogging.h"

#include <atomic>
#include <cstdio>

namespace pagedkv {
namespace plugin {
namespace {

// An atomic pointer rather than a mutex: log calls come from enqueue on TensorRT's threads and must not
// contend. The finder outlives the library's use (TensorRT owns it), so reading it without a lock is safe.
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};

char const* severityName(Severity severity) {
    switch (severity) {
        case Severity::kINTERNAL_ERROR: return "INTERNAL_ERROR";
        case Severity::kERROR: return "ERROR";
        case Severity::kWARNING: return "WARNING";
        case Severity::kINFO: return "INFO";
        case Severity::kVERBOSE: return "VERBOSE";
    }
    return "?";
}

}  // namespace

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept { gLoggerFinder.store(finder); }

void logMessage(Severity severity, std::string const& message) noexcept {
    try {
        nvinfer1::ILogger* logger = nullptr;
        if (nvinfer1::ILoggerFinder* finder = gLoggerFinder.load()) {
            // findLogger() must run on the thread of the plugin call that logs: it is, we are that call.
            logger = finder->findLogger();
        }
        std::string const text = "[pagedkv] " + message;
        if (logger != nullptr) {
            logger->log(severity, text.c_str());
        } else if (severity <= Severity::kWARNING) {
            std::fprintf(stderr, "%s: %s\n", severityName(severity), text.c_str());
        }
    } catch (...) {
        // Logging is best effort: an allocation failure here must not escape a noexcept TensorRT callback.
    }
}

}  // namespace plugin
}  // namespace pagedkv
