// Shape and type checks shared by both plugins' configurePlugin / onShapeChange / enqueue.
//
// ExtentBinder ties the step's extents (T tokens, B sequences, MB block-table width, NP pools) across the
// input tensors: the first tensor that shows an extent binds it, later tensors must agree. At build time
// (configurePlugin) runtime dimensions are -1 and are skipped; at run time every dimension is known.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "pagedkv/qkv_write.h"  // IODType

namespace pagedkv {
namespace plugin {

char const* dataTypeName(nvinfer1::DataType type);
std::string dimsToString(nvinfer1::Dims const& dims);

class ExtentBinder {
public:
    ExtentBinder() { mBindings.reserve(8); }

    // `tensor` must have rank `rank`.
    void expectRank(char const* tensor, nvinfer1::Dims const& dims, int32_t rank) const;
    // dims.d[axis] must equal `expected` (skipped when unknown). `why` explains the expected value.
    void expectExtent(char const* tensor, nvinfer1::Dims const& dims, int32_t axis, int64_t expected,
                      std::string const& why) const;
    // Binds extent `symbol` to dims.d[axis] - offset (e.g. B from cu_q_lens [B+1]: offset 1); a conflict with an
    // earlier binding throws, naming both tensors.
    void bind(char const* symbol, char const* tensor, nvinfer1::Dims const& dims, int32_t axis, int64_t offset = 0);
    // The bound value, or -1 when no tensor showed it (build time).
    int64_t value(char const* symbol) const;

private:
    // onShapeChange runs on every step whose shapes change (every step of a serving loop): bindings keep
    // pointers to literals and a copy of the dims, and strings are built only for an error message.
    struct Binding {
        char const* symbol;
        char const* tensor;
        nvinfer1::Dims dims;
        int64_t value;
    };
    std::vector<Binding> mBindings;
};

// Throws when an extent needed as int32 by the launchers does not fit.
int32_t checkedInt32(int64_t value, char const* what);

// "6 inputs and 1 output": the tensor counts a plugin's attributes call for, as error messages state them.
std::string tensorCounts(int32_t numInputs, int32_t numOutputs);

// getOutputDataTypes / getOutputShapes: throws "expected 6 inputs and 1 output, got 5 and 1" on other counts.
void expectTensorCounts(int32_t nbInputs, int32_t nbOutputs, int32_t expectedInputs, int32_t expectedOutputs);

// supportsFormatCombination: the counts as above and 0 <= pos < nbInputs + nbOutputs, else throws.
void expectFormatPosition(int32_t pos, int32_t nbInputs, int32_t nbOutputs, int32_t expectedInputs,
                          int32_t expectedOutputs);

// The launchers' IODType of a 16-bit activation tensor; anything else throws naming `tensor`.
IODType ioDTypeOf(char const* tensor, nvinfer1::DataType type);
// ...and back: the TensorRT type of an IODType (kHALF, kBF16).
nvinfer1::DataType dataTypeOf(IODType io);

}  // namespace plugin
}  // namespace pagedkv
