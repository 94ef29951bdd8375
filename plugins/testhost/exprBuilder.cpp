#include "exprBuilder.h"

#include <limits>
#include <stdexcept>

namespace testhost {

using nvinfer1::DimensionOperation;

bool applyDimensionOperation(DimensionOperation op, int64_t a, int64_t b, int64_t& out) {
    switch (op) {
        case DimensionOperation::kSUM: out = a + b; return true;
        case DimensionOperation::kPROD: out = a * b; return true;
        case DimensionOperation::kMAX: out = a > b ? a : b; return true;
        case DimensionOperation::kMIN: out = a < b ? a : b; return true;
        case DimensionOperation::kSUB: out = a - b; return true;
        case DimensionOperation::kEQUAL: out = a == b ? 1 : 0; return true;
        case DimensionOperation::kLESS: out = a < b ? 1 : 0; return true;
        case DimensionOperation::kFLOOR_DIV: {
            if (b == 0) return false;
            int64_t q = a / b;
            if ((a % b != 0) && ((a < 0) != (b < 0))) --q;  // C++ truncates toward zero
            out = q;
            return true;
        }
        case DimensionOperation::kCEIL_DIV: {
            if (b == 0) return false;
            int64_t q = a / b;
            if ((a % b != 0) && ((a < 0) == (b < 0))) ++q;
            out = q;
            return true;
        }
    }
    return false;
}

char const* dimensionOperationName(DimensionOperation op) {
    switch (op) {
        case DimensionOperation::kSUM: return "+";
        case DimensionOperation::kPROD: return "*";
        case DimensionOperation::kMAX: return "max";
        case DimensionOperation::kMIN: return "min";
        case DimensionOperation::kSUB: return "-";
        case DimensionOperation::kEQUAL: return "==";
        case DimensionOperation::kLESS: return "<";
        case DimensionOperation::kFLOOR_DIV: return "floordiv";
        case DimensionOperation::kCEIL_DIV: return "ceildiv";
    }
    return "?";
}

// ---- HostDimensionExpr ---------------------------------------------------------------------------------------

std::unique_ptr<HostDimensionExpr> HostDimensionExpr::constant(int64_t value) {
    std::unique_ptr<HostDimensionExpr> e(new HostDimensionExpr());
    e->mKind = Kind::kConstant;
    e->mValue = value;
    return e;
}

std::unique_ptr<HostDimensionExpr> HostDimensionExpr::symbol(std::string name) {
    std::unique_ptr<HostDimensionExpr> e(new HostDimensionExpr());
    e->mKind = Kind::kSymbol;
    e->mName = std::move(name);
    return e;
}

std::unique_ptr<HostDimensionExpr> HostDimensionExpr::operation(DimensionOperation op, HostDimensionExpr const* lhs,
                                                                HostDimensionExpr const* rhs) {
    std::unique_ptr<HostDimensionExpr> e(new HostDimensionExpr());
    e->mKind = Kind::kOperation;
    e->mOp = op;
    e->mLhs = lhs;
    e->mRhs = rhs;
    return e;
}

std::unique_ptr<HostDimensionExpr> HostDimensionExpr::sizeTensor(int32_t outputIndex, HostDimensionExpr const* opt,
                                                                 HostDimensionExpr const* upper) {
    std::unique_ptr<HostDimensionExpr> e(new HostDimensionExpr());
    e->mKind = Kind::kSizeTensor;
    e->mOutputIndex = outputIndex;
    e->mLhs = opt;
    e->mRhs = upper;
    return e;
}

int64_t HostDimensionExpr::getConstantValue() const {
    return mKind == Kind::kConstant ? mValue : std::numeric_limits<int64_t>::min();
}

std::string HostDimensionExpr::toString() const {
    switch (mKind) {
        case Kind::kConstant: return std::to_string(mValue);
        case Kind::kSymbol: return mName;
        case Kind::kSizeTensor:
            return "size_tensor(" + std::to_string(mOutputIndex) + "," + mLhs->toString() + "," + mRhs->toString() +
                   ")";
        case Kind::kOperation: break;
    }
    std::string const name = dimensionOperationName(mOp);
    if (name.size() > 2) return name + "(" + mLhs->toString() + "," + mRhs->toString() + ")";
    return "(" + mLhs->toString() + name + mRhs->toString() + ")";
}

int64_t HostDimensionExpr::evaluate(Bindings const& bindings) const {
    switch (mKind) {
        case Kind::kConstant: return mValue;
        case Kind::kSymbol: {
            auto it = bindings.find(mName);
            if (it == bindings.end()) throw std::runtime_error("no value bound for dimension symbol '" + mName + "'");
            return it->second;
        }
        case Kind::kSizeTensor: throw std::runtime_error("a size tensor has no value before execution");
        case Kind::kOperation: break;
    }
    int64_t out = 0;
    if (!applyDimensionOperation(mOp, mLhs->evaluate(bindings), mRhs->evaluate(bindings), out)) {
        throw std::runtime_error("cannot evaluate " + toString() + " (division by zero?)");
    }
    return out;
}

// ---- HostExprBuilder -----------------------------------------------------------------------------------------

HostDimensionExpr const* HostExprBuilder::keep(std::unique_ptr<HostDimensionExpr> expr) {
    mExprs.push_back(std::move(expr));
    return mExprs.back().get();
}

nvinfer1::IDimensionExpr const* HostExprBuilder::constant(int64_t value) {
    return keep(HostDimensionExpr::constant(value));
}

nvinfer1::IDimensionExpr const* HostExprBuilder::operation(DimensionOperation op, nvinfer1::IDimensionExpr const& first,
                                                           nvinfer1::IDimensionExpr const& second) {
    if (!owns(&first) || !owns(&second)) return nullptr;  // TensorRT would reject foreign expressions too
    HostDimensionExpr const& a = cast(first);
    HostDimensionExpr const& b = cast(second);
    if (a.isConstant() && b.isConstant()) {
        int64_t out = 0;
        if (!applyDimensionOperation(op, a.getConstantValue(), b.getConstantValue(), out)) return nullptr;
        return keep(HostDimensionExpr::constant(out));
    }
    int64_t probe = 0;
    if (!applyDimensionOperation(op, 1, 1, probe)) return nullptr;  // not a DimensionOperation value
    return keep(HostDimensionExpr::operation(op, &a, &b));
}

nvinfer1::IDimensionExpr const* HostExprBuilder::declareSizeTensor(int32_t outputIndex, nvinfer1::IDimensionExpr const& opt,
                                                                   nvinfer1::IDimensionExpr const& upper) {
    if (!owns(&opt) || !owns(&upper)) return nullptr;
    return keep(HostDimensionExpr::sizeTensor(outputIndex, &cast(opt), &cast(upper)));
}

HostDimensionExpr const* HostExprBuilder::symbol(std::string const& name) { return keep(HostDimensionExpr::symbol(name)); }

bool HostExprBuilder::owns(nvinfer1::IDimensionExpr const* expr) const {
    for (auto const& e : mExprs) {
        if (static_cast<nvinfer1::IDimensionExpr const*>(e.get()) == expr) return true;
    }
    return false;
}

}  // namespace testhost
