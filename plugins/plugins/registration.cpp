// The plugin library's entry points. For loaders: IPluginRegistry::loadLibrary, trtexec --dynamicPlugins and
// version-compatible engines (IBuilderConfig::setPluginsToSerialize) dlopen the library, call setLoggerFinder and
// getCreators, and register each creator themselves. The library registers nothing on its own: a loader that
// asks for the creators is their only registrar (a load-time registration would run inside loadLibrary's dlopen
// and make its own registrations fail as duplicates).
//
// Loaders that only dlopen a library (trtexec --staticPlugins, polygraphy --plugins, ctypes.CDLL) take the
// self-registering companion, libpagedkv_plugins_selfreg.so (plugins/selfreg/), which registers these creators
// with the TensorRT library the process has loaded.
#include <NvInferRuntime.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include "attentionPlugin/attentionPlugin.h"
#include "common/pluginLogging.h"
#include "qkvWritePlugin/qkvWritePlugin.h"

namespace pagedkv {
namespace plugin {
namespace {

constexpr int32_t kNumCreators = 2;

// Function-local statics: constructed on the first getCreators call, destroyed when the library unloads.
nvinfer1::IPluginCreatorInterface* const* creatorList() {
    static QKVWritePluginCreator writeCreator;
    static AttentionPluginCreator attentionCreator;
    static nvinfer1::IPluginCreatorInterface* const creators[kNumCreators] = {&writeCreator, &attentionCreator};
    return creators;
}

}  // namespace
}  // namespace plugin
}  // namespace pagedkv

extern "C" {

__attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    try {
        nvinfer1::IPluginCreatorInterface* const* creators = pagedkv::plugin::creatorList();
        nbCreators = pagedkv::plugin::kNumCreators;
        return creators;
    } catch (std::exception const& e) {  // a creator's field table could not be allocated
        pagedkv::plugin::logError(std::string("getCreators: ") + e.what());
    }
    nbCreators = 0;
    return nullptr;
}

__attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
    pagedkv::plugin::setLoggerFinder(finder);
}

// The library's recent warnings and errors (common/pluginLogging.h), for applications whose TensorRT hands over
// no logger that answers: copies them into `buffer` and returns the bytes the whole text needs.
__attribute__((visibility("default"))) size_t pagedkv_plugin_messages(char* buffer, size_t capacity, int32_t clear) {
    return pagedkv::plugin::keptMessages(buffer, capacity, clear != 0);
}

}  // extern "C"
