// Tensor descriptions in the host's specs: {"name": "qkv", "type": "kHALF", "dims": ["T", 384]} where a string
// dimension is a runtime (symbolic) dimension and a number a build-time constant; plus DataType names/sizes.
#pragma once

#include <NvInferRuntime.h>

#include <string>
#include <vector>

#include "exprBuilder.h"
#include "json.h"

namespace testhost {

char const* dataTypeName(nvinfer1::DataType type);
nvinfer1::DataType dataTypeFromName(std::string const& name);  // throws
int64_t dataTypeBytes(nvinfer1::DataType type);                // bytes per element; throws for sub-byte types
std::vector<nvinfer1::DataType> allDataTypes();

struct TensorSpec {
    std::string name;
    nvinfer1::DataType type;
    std::vector<Json> dims;  // int64 constants or symbol names

    static TensorSpec parse(Json const& j);
    // Build-time view: symbols -> -1 (TensorRT's wildcard).
    nvinfer1::Dims buildDims() const;
    // Concrete view under `bindings`.
    nvinfer1::Dims concreteDims(Bindings const& bindings) const;
    nvinfer1::DimsExprs exprs(HostExprBuilder& builder, std::map<std::string, HostDimensionExpr const*>& symbols) const;
};

Bindings parseBindings(Json const& j);
Json dimsToJson(nvinfer1::Dims const& d);
int64_t volume(nvinfer1::Dims const& d);

}  // namespace testhost
