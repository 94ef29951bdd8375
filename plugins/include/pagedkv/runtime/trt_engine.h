// A TensorRT engine as an executor, TensorRT loaded at run time: libpagedkv_runtime compiles and links without
// TensorRT (written against TensorRT 10.14's public headers, NvInferRuntime.h) and needs libnvinfer only when
// an engine is opened. NOT RUN in the workplace that wrote it (no TensorRT, no GPU there): docs/deploy-cpp.md.
//
//   loadTensorRT()        dlopen libnvinfer.so.<the headers' major> (RTLD_LOCAL), the documented factory entry
//                         createInferRuntime_INTERNAL and getInferLibVersion through dlsym; a library of another
//                         major is named, not used (its ABI is not these headers').
//   checkPluginLibrary()  the plugin library provides our two IPluginV3 creators (dlopen + getCreators, what
//                         IPluginRegistry::loadLibrary calls) — checked before TensorRT is needed.
//   openTensorRTEngine()  IRuntime, the plugin library through IRuntime::getPluginRegistry().loadLibrary, the
//                         engine deserialized (an engine built for another GPU or TensorRT version: a clear
//                         error), its I/O checked against the engine-I/O contract (engine_io_check.h), the
//                         optimization profile's maxima as the step limits, one execution context bound by
//                         address to the executor's staged arrays (device.h), enqueueV3 on its stream, decode
//                         steps as CUDA graphs.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "pagedkv/runtime/device.h"
#include "pagedkv/runtime/engine_io_check.h"

namespace pagedkv::runtime {

// libnvinfer could not be loaded (or is not the TensorRT these headers describe): "TensorRT not found: ...".
class TensorRTUnavailable : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
    ~TensorRTUnavailable() override;
};

// The plugin library is missing, not a TensorRT plugin library, not ours, or TensorRT refused it.
class PluginLibraryError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
    ~PluginLibraryError() override;
};

// Loads TensorRT once per process; returns e.g. "TensorRT 10.14.1 (libnvinfer.so.10)". Throws TensorRTUnavailable.
std::string loadTensorRT();

// Throws PluginLibraryError unless `path` loads and its getCreators lists PagedKVQKVWrite and PagedKVAttention
// (IPluginCreatorV3One, namespace "pagedkv"). Needs no TensorRT.
void checkPluginLibrary(std::string const& path);

struct TensorRTOptions {
    std::string engine;             // the serialized engine (pagedkv build)
    std::string pluginLibrary;      // libpagedkv_plugins.so
    std::vector<PoolGroup> groups;  // the engine's pool groups, group g = kv_pools row g (its deploy config)
    DeviceOptions device;
};

// Opens the engine (the header comment). Throws TensorRTUnavailable, PluginLibraryError, EngineMismatchError
// (the I/O differs, or the engine was built for another GPU or TensorRT version), CudaError, std::runtime_error.
std::unique_ptr<DeviceExecutor> openTensorRTEngine(TensorRTOptions const& options);

}  // namespace pagedkv::runtime
