#include "tensorSpec.h"

#include <stdexcept>

namespace testhost {

using nvinfer1::DataType;

namespace {
struct TypeInfo {
    DataType type;
    char const* name;
    int64_t bytes;  // 0: sub-byte
};
constexpr TypeInfo kTypes[] = {
    {DataType::kFLOAT, "kFLOAT", 4}, {DataType::kHALF, "kHALF", 2},   {DataType::kINT8, "kINT8", 1},
    {DataType::kINT32, "kINT32", 4}, {DataType::kBOOL, "kBOOL", 1},   {DataType::kUINT8, "kUINT8", 1},
    {DataType::kFP8, "kFP8", 1},     {DataType::kBF16, "kBF16", 2},   {DataType::kINT64, "kINT64", 8},
    {DataType::kINT4, "kINT4", 0},   {DataType::kFP4, "kFP4", 0},     {DataType::kE8M0, "kE8M0", 1},
};
}  // namespace

char const* dataTypeName(DataType type) {
    for (TypeInfo const& t : kTypes) {
        if (t.type == type) return t.name;
    }
    return "(invalid DataType)";
}

DataType dataTypeFromName(std::string const& name) {
    for (TypeInfo const& t : kTypes) {
        if (name == t.name) return t.type;
    }
    throw std::runtime_error("unknown DataType name '" + name + "'");
}

int64_t dataTypeBytes(DataType type) {
    for (TypeInfo const& t : kTypes) {
        if (t.type == type && t.bytes > 0) return t.bytes;
    }
    throw std::runtime_error(std::string("no byte size for ") + dataTypeName(type));
}

std::vector<DataType> allDataTypes() {
    std::vector<DataType> out;
    for (TypeInfo const& t : kTypes) out.push_back(t.type);
    return out;
}

TensorSpec TensorSpec::parse(Json const& j) {
    TensorSpec t;
    t.name = j.has("name") ? j.at("name").asString() : std::string();
    t.type = dataTypeFromName(j.at("type").asString());
    t.dims = j.at("dims").items();
    if (t.dims.size() > static_cast<size_t>(nvinfer1::Dims::MAX_DIMS)) throw std::runtime_error("too many dims");
    return t;
}

nvinfer1::Dims TensorSpec::buildDims() const {
    nvinfer1::Dims d{};
    d.nbDims = static_cast<int32_t>(dims.size());
    for (size_t i = 0; i < dims.size(); ++i) d.d[i] = dims[i].isString() ? -1 : dims[i].asInt();
    return d;
}

nvinfer1::Dims TensorSpec::concreteDims(Bindings const& bindings) const {
    nvinfer1::Dims d{};
    d.nbDims = static_cast<int32_t>(dims.size());
    for (size_t i = 0; i < dims.size(); ++i) {
        if (dims[i].isString()) {
            auto it = bindings.find(dims[i].asString());
            if (it == bindings.end()) throw std::runtime_error("no value bound for '" + dims[i].asString() + "'");
            d.d[i] = it->second;
        } else {
            d.d[i] = dims[i].asInt();
        }
    }
    return d;
}

nvinfer1::DimsExprs TensorSpec::exprs(HostExprBuilder& builder,
                                      std::map<std::string, HostDimensionExpr const*>& symbols) const {
    nvinfer1::DimsExprs e{};
    e.nbDims = static_cast<int32_t>(dims.size());
    for (size_t i = 0; i < dims.size(); ++i) {
        if (dims[i].isString()) {
            std::string const& symbol = dims[i].asString();
            if (!symbols.count(symbol)) symbols[symbol] = builder.symbol(symbol);
            e.d[i] = symbols[symbol];
        } else {
            e.d[i] = builder.constant(dims[i].asInt());
        }
    }
    return e;
}

Bindings parseBindings(Json const& j) {
    Bindings b;
    if (j.isNull()) return b;
    for (auto const& m : j.members()) b[m.first] = m.second.asInt();
    return b;
}

Json dimsToJson(nvinfer1::Dims const& d) {
    Json out = Json::array();
    for (int32_t i = 0; i < d.nbDims; ++i) out.push(Json(int64_t(d.d[i])));
    return out;
}

int64_t volume(nvinfer1::Dims const& d) {
    int64_t v = 1;
    for (int32_t i = 0; i < d.nbDims; ++i) v *= d.d[i];
    return v;
}

}  // namespace testhost
