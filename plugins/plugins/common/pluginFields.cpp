#include "common/pluginFields.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>

#include "common/pluginErrors.h"

namespace pagedkv {
namespace plugin {
namespace {

using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;

constexpr double kInt32Min = static_cast<double>(std::numeric_limits<int32_t>::min());
constexpr double kInt32Max = static_cast<double>(std::numeric_limits<int32_t>::max());
constexpr double kFloatMax = static_cast<double>(std::numeric_limits<float>::max());

std::string formatValue(double value, FieldKind kind) {
    std::ostringstream os;
    if (kind == FieldKind::kInt && std::isfinite(value)) {
        os << static_cast<int64_t>(value);
    } else {
        os.precision(9);
        os << value;
    }
    return os.str();
}

// A field name in quotes, fit for a log line: a name from corrupt plugin data can hold any bytes, so non-printable
// ones are escaped (\xNN) and a long one is cut.
std::string quoted(std::string const& name) {
    constexpr size_t kMaxShown = 64;
    std::string out = "'";
    for (size_t i = 0; i < name.size() && i < kMaxShown; ++i) {
        auto const c = static_cast<unsigned char>(name[i]);
        if (c >= 0x20 && c < 0x7f && c != '\\') {
            out.push_back(static_cast<char>(c));
        } else {
            char escaped[5];
            std::snprintf(escaped, sizeof(escaped), "\\x%02x", c);
            out += escaped;
        }
    }
    if (name.size() > kMaxShown) out += "...";
    return out + "'";
}

// Reads the single value of `field` as the kind the spec wants, or throws naming the field. The type is checked
// first (the most telling mismatch), then the length, then the data pointer; nothing is read before all three hold.
double readValue(PluginField const& field, FieldSpec const& spec) {
    std::string const where = "field " + quoted(spec.name);
    bool const isInt = spec.kind == FieldKind::kInt;
    bool const typeOk = isInt ? (field.type == PluginFieldType::kINT32 || field.type == PluginFieldType::kINT64)
                              : (field.type == PluginFieldType::kFLOAT32 || field.type == PluginFieldType::kFLOAT64);
    if (!typeOk) {
        throw PluginError(where + (isInt ? ": expected an integer field (kINT32, from an ONNX INT attribute), got "
                                         : ": expected a float field (kFLOAT32, from an ONNX FLOAT attribute), got ") +
                          fieldTypeName(field.type) + " with length " + std::to_string(field.length));
    }
    if (field.length != 1) {
        throw PluginError(where + ": expected exactly 1 value, got length " + std::to_string(field.length));
    }
    if (field.data == nullptr) throw PluginError(where + ": data pointer is null");
    switch (field.type) {
        case PluginFieldType::kINT32: return *static_cast<int32_t const*>(field.data);
        case PluginFieldType::kINT64: {
            int64_t const v = *static_cast<int64_t const*>(field.data);
            if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
                throw PluginError(where + "=" + std::to_string(v) + " (kINT64): does not fit in int32");
            }
            return static_cast<double>(v);
        }
        case PluginFieldType::kFLOAT32: return *static_cast<float const*>(field.data);
        default: {  // kFLOAT64
            double const v = *static_cast<double const*>(field.data);
            if (std::isfinite(v) && std::fabs(v) > kFloatMax) {
                throw PluginError(where + "=" + formatValue(v, FieldKind::kFloat) + " (kFLOAT64): overflows float32");
            }
            // The plugin computes with (and serializes) the float32 value: that is the one to check, so that a
            // tiny positive double that rounds to 0 is refused here rather than after a serialization round trip.
            return static_cast<double>(static_cast<float>(v));
        }
    }
}

// Reads the values of the array field `field` (kFLOAT32 or kFLOAT64, length <= spec.maxLength), each checked
// against the spec's range; throws naming the field, the index and the value.
std::vector<float> readArray(PluginField const& field, FieldSpec const& spec) {
    std::string const where = "field " + quoted(spec.name);
    if (field.type != PluginFieldType::kFLOAT32 && field.type != PluginFieldType::kFLOAT64) {
        throw PluginError(where + ": expected a float array (kFLOAT32, from an ONNX FLOATS attribute), got " +
                          fieldTypeName(field.type) + " with length " + std::to_string(field.length));
    }
    if (field.length < 0 || field.length > spec.maxLength) {
        throw PluginError(where + ": expected at most " + std::to_string(spec.maxLength) + " values, got length " +
                          std::to_string(field.length));
    }
    if (field.length > 0 && field.data == nullptr) throw PluginError(where + ": data pointer is null");
    std::vector<float> out(static_cast<size_t>(field.length));
    for (int32_t i = 0; i < field.length; ++i) {
        double const v = field.type == PluginFieldType::kFLOAT32 ? static_cast<float const*>(field.data)[i]
                                                                 : static_cast<double const*>(field.data)[i];
        if (!spec.accepts(v)) {
            throw PluginError(where + "[" + std::to_string(i) + "]=" + formatValue(v, FieldKind::kFloat) +
                              ": expected " + spec.describeAccepted());
        }
        out[static_cast<size_t>(i)] = static_cast<float>(v);
    }
    return out;
}

bool isIgnoredSilently(char const* name) {
    // The ONNX parser consumes these to pick the creator; a direct caller may still pass them.
    return std::strcmp(name, "plugin_version") == 0 || std::strcmp(name, "plugin_namespace") == 0;
}

}  // namespace

// ---- FieldSpec -----------------------------------------------------------------------------------------------

FieldSpec FieldSpec::requiredInt(char const* name, int64_t minValue, int64_t maxValue) {
    return FieldSpec{name, FieldKind::kInt, true, 0.0, double(minValue), double(maxValue), false, {}, ""};
}

FieldSpec FieldSpec::optionalInt(char const* name, int32_t defaultValue, int64_t minValue, int64_t maxValue) {
    return FieldSpec{name, FieldKind::kInt, false, double(defaultValue), double(minValue), double(maxValue),
                     false, {}, ""};
}

FieldSpec FieldSpec::requiredIntOneOf(char const* name, std::vector<int32_t> values, char const* note) {
    return FieldSpec{name, FieldKind::kInt, true, 0.0, kInt32Min, kInt32Max, false, std::move(values), note};
}

FieldSpec FieldSpec::intOneOf(char const* name, int32_t defaultValue, std::vector<int32_t> values,
                              char const* note) {
    return FieldSpec{name, FieldKind::kInt, false, double(defaultValue), kInt32Min, kInt32Max, false,
                     std::move(values), note};
}

FieldSpec FieldSpec::flag(char const* name, bool defaultValue) {
    return intOneOf(name, defaultValue ? 1 : 0, {0, 1});
}

FieldSpec FieldSpec::positiveFloat(char const* name, float defaultValue) {
    return FieldSpec{name, FieldKind::kFloat, false, double(defaultValue), 0.0, kFloatMax, true, {}, ""};
}

FieldSpec FieldSpec::nonNegativeFloat(char const* name, float defaultValue) {
    return FieldSpec{name, FieldKind::kFloat, false, double(defaultValue), 0.0, kFloatMax, false, {}, ""};
}

FieldSpec FieldSpec::positiveFloats(char const* name, int32_t maxLength) {
    return FieldSpec{name, FieldKind::kFloatArray, false, 0.0, 0.0, kFloatMax, true, {}, "", maxLength};
}

std::string FieldSpec::describeAccepted() const {
    std::ostringstream os;
    if (!oneOf.empty()) {
        os << "one of {";
        for (size_t i = 0; i < oneOf.size(); ++i) os << (i ? ", " : "") << oneOf[i];
        os << "}";
    } else if (kind != FieldKind::kInt) {
        os << "finite and " << (minExclusive ? "> " : ">= ") << formatValue(minValue, FieldKind::kFloat);
    } else {
        os << "in [" << formatValue(minValue, kind) << ", " << formatValue(maxValue, kind) << "]";
    }
    if (!note.empty()) os << " (" << note << ")";
    return os.str();
}

bool FieldSpec::accepts(double value) const {
    if (!std::isfinite(value)) return false;
    if (!oneOf.empty()) {
        for (int32_t v : oneOf) {
            if (double(v) == value) return true;
        }
        return false;
    }
    bool const aboveMin = minExclusive ? value > minValue : value >= minValue;
    return aboveMin && value <= maxValue;
}

// ---- FieldValues ---------------------------------------------------------------------------------------------

FieldValues::FieldValues(std::vector<FieldSpec> const& specs, std::vector<double> values,
                         std::vector<std::vector<float>> arrays)
    : mSpecs(&specs), mValues(std::move(values)), mArrays(std::move(arrays)) {
    if (mArrays.empty()) mArrays.resize(mSpecs->size());
    if (mValues.size() != mSpecs->size() || mArrays.size() != mSpecs->size())
        throw PluginError("internal: FieldValues size mismatch");
}

size_t FieldValues::find(char const* name, FieldKind kind) const {
    for (size_t i = 0; i < mSpecs->size(); ++i) {
        if ((*mSpecs)[i].name == name) {
            if ((*mSpecs)[i].kind != kind) throw PluginError(std::string("internal: field '") + name + "' kind");
            return i;
        }
    }
    throw PluginError(std::string("internal: no field named '") + name + "'");
}

int32_t FieldValues::getInt(char const* name) const {
    return static_cast<int32_t>(mValues[find(name, FieldKind::kInt)]);
}

float FieldValues::getFloat(char const* name) const { return static_cast<float>(mValues[find(name, FieldKind::kFloat)]); }

std::vector<float> const& FieldValues::getFloats(char const* name) const {
    return mArrays[find(name, FieldKind::kFloatArray)];
}

// ---- parseFields ---------------------------------------------------------------------------------------------

FieldValues parseFields(std::vector<FieldSpec> const& specs, PluginFieldCollection const* fc,
                        nvinfer1::TensorRTPhase phase, char const* pluginName) {
    if (fc == nullptr) throw PluginError("no PluginFieldCollection given");
    if (fc->nbFields < 0) throw PluginError("PluginFieldCollection.nbFields=" + std::to_string(fc->nbFields));
    if (fc->nbFields > 0 && fc->fields == nullptr) {
        throw PluginError("PluginFieldCollection.fields is null with nbFields=" + std::to_string(fc->nbFields));
    }
    std::vector<double> values(specs.size());
    std::vector<std::vector<float>> arrays(specs.size());
    std::vector<bool> seen(specs.size(), false);
    for (int32_t i = 0; i < fc->nbFields; ++i) {
        PluginField const& field = fc->fields[i];
        if (field.name == nullptr) throw PluginError("field #" + std::to_string(i) + " has no name");
        if (isIgnoredSilently(field.name)) continue;
        size_t index = specs.size();
        for (size_t s = 0; s < specs.size(); ++s) {
            if (specs[s].name == field.name) index = s;
        }
        if (index == specs.size()) {
            logWarning(std::string(pluginName) + ": ignoring unknown field " + quoted(field.name));
            continue;
        }
        FieldSpec const& spec = specs[index];
        if (seen[index]) throw PluginError("field " + quoted(spec.name) + " given twice");
        seen[index] = true;
        if (spec.kind == FieldKind::kFloatArray) {
            arrays[index] = readArray(field, spec);
            continue;
        }
        double const value = readValue(field, spec);
        if (!spec.accepts(value)) {
            throw PluginError("field " + quoted(spec.name) + "=" + formatValue(value, spec.kind) + ": expected " +
                              spec.describeAccepted());
        }
        values[index] = value;
    }
    std::string missing;
    for (size_t s = 0; s < specs.size(); ++s) {
        if (seen[s] || specs[s].kind == FieldKind::kFloatArray) continue;  // an absent array is empty
        if (phase == nvinfer1::TensorRTPhase::kRUNTIME || specs[s].required) {
            missing += (missing.empty() ? "" : ", ") + quoted(specs[s].name);
        } else {
            values[s] = specs[s].defaultValue;
        }
    }
    if (!missing.empty()) {
        throw PluginError(phase == nvinfer1::TensorRTPhase::kRUNTIME
                              ? "serialized plugin data is incomplete: missing field(s) " + missing
                              : "missing required field(s) " + missing);
    }
    return FieldValues(specs, std::move(values), std::move(arrays));
}

// ---- FieldCollection -----------------------------------------------------------------------------------------

FieldCollection::FieldCollection(std::vector<FieldSpec> const& specs) { build(specs, nullptr); }

FieldCollection::FieldCollection(FieldValues const& values) { build(values.specs(), &values); }

void FieldCollection::build(std::vector<FieldSpec> const& specs, FieldValues const* values) {
    // Sized once: PluginField::data points into these vectors, which never reallocate afterwards.
    mInts.assign(specs.size(), 0);
    mFloats.assign(specs.size(), 0.f);
    mArrays = values != nullptr ? values->arrays() : std::vector<std::vector<float>>(specs.size());
    mFields.clear();
    mFields.reserve(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
        FieldSpec const& spec = specs[i];
        auto const type = spec.kind == FieldKind::kInt ? PluginFieldType::kINT32 : PluginFieldType::kFLOAT32;
        if (spec.kind == FieldKind::kFloatArray) {
            if (values == nullptr) {
                mFields.emplace_back(spec.name.c_str(), nullptr, type, 0);  // a name: no length yet
            } else if (!mArrays[i].empty()) {  // an empty array stays out (absent reads back as empty)
                mFields.emplace_back(spec.name.c_str(), mArrays[i].data(), type,
                                     static_cast<int32_t>(mArrays[i].size()));
            }
            continue;
        }
        void const* data = nullptr;
        if (values != nullptr) {
            if (spec.kind == FieldKind::kInt) {
                mInts[i] = static_cast<int32_t>(values->values()[i]);
                data = &mInts[i];
            } else {
                mFloats[i] = static_cast<float>(values->values()[i]);
                data = &mFloats[i];
            }
        }
        mFields.emplace_back(spec.name.c_str(), data, type, 1);
    }
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
}

char const* fieldTypeName(PluginFieldType type) {
    switch (type) {
        case PluginFieldType::kFLOAT16: return "kFLOAT16";
        case PluginFieldType::kFLOAT32: return "kFLOAT32";
        case PluginFieldType::kFLOAT64: return "kFLOAT64";
        case PluginFieldType::kINT8: return "kINT8";
        case PluginFieldType::kINT16: return "kINT16";
        case PluginFieldType::kINT32: return "kINT32";
        case PluginFieldType::kCHAR: return "kCHAR";
        case PluginFieldType::kDIMS: return "kDIMS";
        case PluginFieldType::kUNKNOWN: return "kUNKNOWN";
        case PluginFieldType::kBF16: return "kBF16";
        case PluginFieldType::kINT64: return "kINT64";
        case PluginFieldType::kFP8: return "kFP8";
        case PluginFieldType::kINT4: return "kINT4";
        case PluginFieldType::kFP4: return "kFP4";
    }
    return "(unknown PluginFieldType)";
}

char const* phaseName(nvinfer1::TensorRTPhase phase) {
    return phase == nvinfer1::TensorRTPhase::kBUILD ? "build" : phase == nvinfer1::TensorRTPhase::kRUNTIME ? "runtime" : "?";
}

}  // namespace plugin
}  // namespace pagedkv
