// The host's checks: each drives the plugin library through TensorRT's public interfaces only, in the order
// TensorRT calls them, and returns a JSON report that the Python tests assert on
// (tests/test_plugin_library.py). Nothing here judges the results; the tests do.
#pragma once

#include <NvInferRuntime.h>

#include <memory>
#include <string>

#include "fieldSet.h"
#include "json.h"
#include "pluginLibrary.h"

namespace testhost {

// Deletes an IPluginV3 the way TensorRT does (plain delete through the virtual destructor).
struct PluginDeleter {
    void operator()(nvinfer1::IPluginV3* p) const { delete p; }
};
using PluginPtr = std::unique_ptr<nvinfer1::IPluginV3, PluginDeleter>;

// A resource context as an execution context gives attachToContext; our plugins need no resources.
class HostResourceContext final : public nvinfer1::IPluginResourceContext {
public:
    nvinfer1::IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
    nvinfer1::IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
};

// The capability interfaces of a plugin, cast only after their interface kind was checked.
struct Capabilities {
    nvinfer1::IPluginV3OneCore* core = nullptr;
    nvinfer1::IPluginV3OneBuild* build = nullptr;
    nvinfer1::IPluginV3OneRuntime* runtime = nullptr;
    Json report;  // {"core": "PLUGIN_V3ONE_CORE 1.0", ...}, null where absent or of the wrong kind
};
Capabilities capabilitiesOf(nvinfer1::IPluginV3* plugin);

// Field set of a spec: "caller": "onnx_parser" (default) or "direct"; "attrs": {...}.
FieldSet fieldSetOf(nvinfer1::IPluginCreatorV3One* creator, Json const& spec);

// `info`: creators with name, version, namespace, interface and field names/types.
Json runInfo(PluginLibrary& library);

// `create`: createPlugin in the given phase ("build" | "runtime"); {"created", "messages", "fields", "blob"}
// ("blob": the serialized fields as FieldSet::toBlob bytes, hex). "logger" picks where messages can go.
Json runCreate(PluginLibrary& library, Json const& spec);

// `fuzz`: createPlugin on each case of a JSON array, in one process: {"plugin", "phase", "caller", "attrs"} (as
// `create`) or {"plugin", "phase", "blob": hex} (FieldSet::fromBlob); "collection": "null" | "negative_count" |
// "null_fields" malforms the PluginFieldCollection itself. An accepted case is serialized, deserialized
// and cloned as well. {"results": [{"created", "round_trip", "messages": ["ERROR: ...", ...]}, ...]}.
Json runFuzz(PluginLibrary& library, Json const& cases);

// `check`: the whole build and runtime interface of one plugin for one configuration (see checks.cpp).
Json runCheck(PluginLibrary& library, Json const& spec);

// `exprs`: the host's own IExprBuilder, every DimensionOperation on the given operand pairs, folded (both
// constants) and symbolic (evaluated later), so the tests can hold it to TensorRT's semantics.
Json runExprSelfTest(Json const& pairs);

// `selfreg`: the library's load-time registration against the host registry, one scenario per process:
// "static", "load_library", "no_registry", "preregistered".
Json runSelfRegistration(std::string const& libraryPath, std::string const& scenario);

}  // namespace testhost
