// TEMPORARY (being replaced by the plugin work): exports the loader entry points with no creators yet.
#include <NvInferRuntime.h>
extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    nbCreators = 0;
    return nullptr;
}
extern "C" __attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder*) {}
