// The test host's IExprBuilder / IDimensionExpr: what TensorRT hands to getOutputShapes. Expressions are
// constants, named symbols (runtime dimensions such as T or B) or operations on two expressions; constant
// operands fold like TensorRT folds them. A symbolic result can be printed ("T", "(T*2)") and evaluated for
// concrete symbol values.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace testhost {

using Bindings = std::map<std::string, int64_t>;

// Both faces of one expression: the public IDimensionExpr the plugin sees, and the VDimensionExpr
// implementation its inline methods call through mImpl.
class HostDimensionExpr final : public nvinfer1::IDimensionExpr, public nvinfer1::apiv::VDimensionExpr {
public:
    enum class Kind { kConstant, kSymbol, kOperation, kSizeTensor };

    static std::unique_ptr<HostDimensionExpr> constant(int64_t value);
    static std::unique_ptr<HostDimensionExpr> symbol(std::string name);
    static std::unique_ptr<HostDimensionExpr> operation(nvinfer1::DimensionOperation op, HostDimensionExpr const* lhs,
                                                        HostDimensionExpr const* rhs);
    static std::unique_ptr<HostDimensionExpr> sizeTensor(int32_t outputIndex, HostDimensionExpr const* opt,
                                                         HostDimensionExpr const* upper);
    ~HostDimensionExpr() noexcept override = default;

    // apiv::VDimensionExpr
    bool isConstant() const override { return mKind == Kind::kConstant; }
    int64_t getConstantValue() const override;
    bool isSizeTensor() const override { return mKind == Kind::kSizeTensor; }

    std::string toString() const;
    // Value under `bindings`; throws naming an unbound symbol or a division by zero.
    int64_t evaluate(Bindings const& bindings) const;

private:
    HostDimensionExpr() { mImpl = this; }

    Kind mKind = Kind::kConstant;
    int64_t mValue = 0;
    std::string mName;
    nvinfer1::DimensionOperation mOp{};
    HostDimensionExpr const* mLhs = nullptr;  // owned by the builder
    HostDimensionExpr const* mRhs = nullptr;
    int32_t mOutputIndex = -1;
};

// Applies `op` to two values with TensorRT's semantics (floor/ceil division round toward -inf/+inf).
// Returns false for a division by zero or an unknown operation.
bool applyDimensionOperation(nvinfer1::DimensionOperation op, int64_t a, int64_t b, int64_t& out);
char const* dimensionOperationName(nvinfer1::DimensionOperation op);

class HostExprBuilder final : public nvinfer1::IExprBuilder, public nvinfer1::apiv::VExprBuilder {
public:
    HostExprBuilder() { mImpl = this; }
    ~HostExprBuilder() noexcept override = default;

    // apiv::VExprBuilder
    nvinfer1::IDimensionExpr const* constant(int64_t value) override;
    nvinfer1::IDimensionExpr const* operation(nvinfer1::DimensionOperation op, nvinfer1::IDimensionExpr const& first,
                                              nvinfer1::IDimensionExpr const& second) override;
    nvinfer1::IDimensionExpr const* declareSizeTensor(int32_t outputIndex, nvinfer1::IDimensionExpr const& opt,
                                                      nvinfer1::IDimensionExpr const& upper) override;

    // Host side: a named runtime dimension.
    HostDimensionExpr const* symbol(std::string const& name);
    // Is `expr` one of this builder's expressions (a plugin must never invent its own)?
    bool owns(nvinfer1::IDimensionExpr const* expr) const;
    static HostDimensionExpr const& cast(nvinfer1::IDimensionExpr const& expr) {
        return static_cast<HostDimensionExpr const&>(expr);
    }

private:
    HostDimensionExpr const* keep(std::unique_ptr<HostDimensionExpr> expr);
    std::vector<std::unique_ptr<HostDimensionExpr>> mExprs;
};

}  // namespace testhost
