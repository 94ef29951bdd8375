#include "common/tensorChecks.h"

#include <cstring>
#include <limits>
#include <sstream>

#include "common/pluginErrors.h"

namespace pagedkv {
namespace plugin {

char const* dataTypeName(nvinfer1::DataType type) {
    using nvinfer1::DataType;
    switch (type) {
        case DataType::kFLOAT: return "kFLOAT";
        case DataType::kHALF: return "kHALF";
        case DataType::kINT8: return "kINT8";
        case DataType::kINT32: return "kINT32";
        case DataType::kBOOL: return "kBOOL";
        case DataType::kUINT8: return "kUINT8";
        case DataType::kFP8: return "kFP8";
        case DataType::kBF16: return "kBF16";
        case DataType::kINT64: return "kINT64";
        case DataType::kINT4: return "kINT4";
        case DataType::kFP4: return "kFP4";
        case DataType::kE8M0: return "kE8M0";
    }
    return "(unknown DataType)";
}

std::string dimsToString(nvinfer1::Dims const& dims) {
    std::ostringstream os;
    os << "[";
    for (int32_t i = 0; i < dims.nbDims && i < nvinfer1::Dims::MAX_DIMS; ++i) os << (i ? "," : "") << dims.d[i];
    os << "]";
    return os.str();
}

void ExtentBinder::expectRank(char const* tensor, nvinfer1::Dims const& dims, int32_t rank) const {
    if (dims.nbDims != rank) {
        throw PluginError(std::string(tensor) + " dims " + dimsToString(dims) + ": expected rank " +
                          std::to_string(rank) + ", got " + std::to_string(dims.nbDims));
    }
}

void ExtentBinder::expectExtent(char const* tensor, nvinfer1::Dims const& dims, int32_t axis, int64_t expected,
                                std::string const& why) const {
    int64_t const got = dims.d[axis];
    if (got >= 0 && got != expected) {
        throw PluginError(std::string(tensor) + " dims " + dimsToString(dims) + ": dim " + std::to_string(axis) +
                          " = " + std::to_string(got) + ", expected " + std::to_string(expected) + " (" + why + ")");
    }
}

void ExtentBinder::bind(char const* symbol, char const* tensor, nvinfer1::Dims const& dims, int32_t axis,
                        int64_t offset) {
    int64_t const got = dims.d[axis];
    if (got < 0) return;  // runtime dimension at build time
    int64_t const v = got - offset;
    if (v < 0) {
        throw PluginError(std::string(tensor) + " dims " + dimsToString(dims) + ": dim " + std::to_string(axis) +
                          " = " + std::to_string(got) + " implies " + symbol + " = " + std::to_string(v) + " < 0");
    }
    for (Binding const& b : mBindings) {
        if (std::strcmp(b.symbol, symbol) == 0) {
            if (b.value != v) {
                throw PluginError(std::string(tensor) + " dims " + dimsToString(dims) + " implies " + symbol + " = " +
                                  std::to_string(v) + ", but " + b.tensor + " dims " + dimsToString(b.dims) +
                                  " gave " + symbol + " = " + std::to_string(b.value));
            }
            return;
        }
    }
    mBindings.push_back(Binding{symbol, tensor, dims, v});
}

int64_t ExtentBinder::value(char const* symbol) const {
    for (Binding const& b : mBindings) {
        if (std::strcmp(b.symbol, symbol) == 0) return b.value;
    }
    return -1;
}

int32_t checkedInt32(int64_t value, char const* what) {
    if (value < 0 || value > std::numeric_limits<int32_t>::max()) {
        throw PluginError(std::string(what) + " = " + std::to_string(value) + ": outside [0, INT32_MAX]");
    }
    return static_cast<int32_t>(value);
}

std::string tensorCounts(int32_t numInputs, int32_t numOutputs) {
    return std::to_string(numInputs) + (numInputs == 1 ? " input" : " inputs") + " and " +
           std::to_string(numOutputs) + (numOutputs == 1 ? " output" : " outputs");
}

void expectTensorCounts(int32_t nbInputs, int32_t nbOutputs, int32_t expectedInputs, int32_t expectedOutputs) {
    if (nbInputs != expectedInputs || nbOutputs != expectedOutputs) {
        throw PluginError("expected " + tensorCounts(expectedInputs, expectedOutputs) + ", got " +
                          std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
    }
}

void expectFormatPosition(int32_t pos, int32_t nbInputs, int32_t nbOutputs, int32_t expectedInputs,
                          int32_t expectedOutputs) {
    if (nbInputs != expectedInputs || nbOutputs != expectedOutputs || pos < 0 || pos >= nbInputs + nbOutputs) {
        throw PluginError("pos=" + std::to_string(pos) + " with " + std::to_string(nbInputs) + " inputs and " +
                          std::to_string(nbOutputs) + " outputs; expected " +
                          tensorCounts(expectedInputs, expectedOutputs));
    }
}

IODType ioDTypeOf(char const* tensor, nvinfer1::DataType type) {
    if (type == nvinfer1::DataType::kHALF) return IODType::kFP16;
    if (type == nvinfer1::DataType::kBF16) return IODType::kBF16;
    throw PluginError(std::string(tensor) + ": type " + dataTypeName(type) + ", expected kHALF|kBF16");
}

nvinfer1::DataType dataTypeOf(IODType io) {
    return io == IODType::kBF16 ? nvinfer1::DataType::kBF16 : nvinfer1::DataType::kHALF;
}

}  // namespace plugin
}  // namespace pagedkv
