#include "common/pluginLogging.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>

namespace pagedkv {
namespace plugin {
namespace {

// An atomic pointer rather than a mutex: log calls come from enqueue on TensorRT's threads and must not
// contend. The finder outlives the library's use (TensorRT owns it), so reading it without a lock is safe.
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};

// The kept warnings and errors (rare: one mutex is no contention). Constructed on first use: a static
// initializer elsewhere (the self-registration) may log before this file's globals exist.
struct KeptMessages {
    std::mutex mutex;
    std::deque<std::string> messages;
};
KeptMessages& kept() {
    static KeptMessages* store = new KeptMessages();  // never destroyed: logging may run during unload
    return *store;
}

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
        if (severity <= Severity::kWARNING) {
            KeptMessages& store = kept();
            std::lock_guard<std::mutex> lock(store.mutex);
            store.messages.push_back(std::string(severityName(severity)) + ": " + text);
            if (store.messages.size() > kMaxKeptMessages) store.messages.pop_front();
        }
        if (logger != nullptr) {
            logger->log(severity, text.c_str());
        } else if (severity <= Severity::kWARNING) {
            std::fprintf(stderr, "%s: %s\n", severityName(severity), text.c_str());
        }
    } catch (...) {
        // Logging is best effort: an allocation failure here must not escape a noexcept TensorRT callback.
    }
}

size_t keptMessages(char* buffer, size_t capacity, bool clear) noexcept {
    try {
        KeptMessages& store = kept();
        std::lock_guard<std::mutex> lock(store.mutex);
        std::string text;
        for (std::string const& m : store.messages) text += m + "\n";
        if (clear) store.messages.clear();
        if (buffer != nullptr && capacity > 0) {
            size_t const n = text.size() < capacity - 1 ? text.size() : capacity - 1;
            std::memcpy(buffer, text.data(), n);
            buffer[n] = '\0';
        }
        return text.size();
    } catch (...) {
        return 0;
    }
}

}  // namespace plugin
}  // namespace pagedkv
