// One field-parsing helper for both plugins: attribute tables (FieldSpec), parsing a PluginFieldCollection
// into validated values (FieldValues), and the collections the creators and plugins hand back to TensorRT
// (getFieldNames, getFieldsToSerialize).
//
// Field types follow the TensorRT ONNX parser (onnx-tensorrt): an ONNX INT attribute arrives as kINT32 (64-bit
// values truncated by the parser), a FLOAT attribute as kFLOAT32, a FLOATS attribute as kFLOAT32 of its length.
// Callers of the C++/Python API sometimes pass kINT64 / kFLOAT64; those are accepted when the value is exactly
// representable. Every other type, a length other than 1 (arrays: above their maximum), null data, a value
// outside the field's range, a duplicate, or a missing scalar field is an error that names the field and the
// value. An array field may be absent in both phases: it is then empty (ONNX cannot type an empty FLOATS list,
// so the builder leaves empty ones out, and getFieldsToSerialize does the same). Names the plugin does not know are ignored with a warning (the parser
// contract: only names listed by getFieldNames are read), and plugin_version / plugin_namespace silently.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace pagedkv {
namespace plugin {

enum class FieldKind : int32_t {
    kInt,         // ONNX INT -> kINT32
    kFloat,       // ONNX FLOAT -> kFLOAT32
    kFloatArray,  // ONNX FLOATS -> kFLOAT32 of length [0, maxLength]; each value in the accepted range
};

// One plugin attribute: name (== the ONNX attribute name == src/pagedkv/config.py's key), kind, default and
// accepted values.
struct FieldSpec {
    std::string name;
    FieldKind kind;
    bool required;          // build phase: must be given. Run time: every field must be present.
    double defaultValue;    // used when an optional field is absent at build time
    double minValue;        // accepted range: [minValue, maxValue], or (minValue, maxValue] when minExclusive
    double maxValue;
    bool minExclusive;
    std::vector<int32_t> oneOf;  // ints: when not empty, the only accepted values
    std::string note;            // appended to a range error (e.g. why a value is reserved)
    int32_t maxLength = 1;       // arrays: the most values accepted

    static FieldSpec requiredInt(char const* name, int64_t minValue, int64_t maxValue);
    static FieldSpec optionalInt(char const* name, int32_t defaultValue, int64_t minValue, int64_t maxValue);
    static FieldSpec requiredIntOneOf(char const* name, std::vector<int32_t> values, char const* note = "");
    static FieldSpec intOneOf(char const* name, int32_t defaultValue, std::vector<int32_t> values,
                              char const* note = "");
    static FieldSpec flag(char const* name, bool defaultValue);  // 0 or 1
    static FieldSpec positiveFloat(char const* name, float defaultValue);     // finite and > 0
    static FieldSpec nonNegativeFloat(char const* name, float defaultValue);  // finite and >= 0
    static FieldSpec positiveFloats(char const* name, int32_t maxLength);     // each finite and > 0; default empty

    // "in [1, 1024]", "one of {64, 128, 256}", "finite and > 0"
    std::string describeAccepted() const;
    bool accepts(double value) const;
};

// Validated values of one plugin's fields, in the order of its FieldSpec table.
class FieldValues {
public:
    // values: one per spec (arrays: unused); arrays: one per spec, empty for scalars (or none at all: all empty)
    FieldValues(std::vector<FieldSpec> const& specs, std::vector<double> values,
                std::vector<std::vector<float>> arrays = {});

    int32_t getInt(char const* name) const;
    float getFloat(char const* name) const;
    bool getFlag(char const* name) const { return getInt(name) != 0; }
    std::vector<float> const& getFloats(char const* name) const;

    std::vector<FieldSpec> const& specs() const { return *mSpecs; }
    std::vector<double> const& values() const { return mValues; }
    std::vector<std::vector<float>> const& arrays() const { return mArrays; }

private:
    size_t find(char const* name, FieldKind kind) const;

    std::vector<FieldSpec> const* mSpecs;  // a plugin's static table: outlives every FieldValues
    std::vector<double> mValues;
    std::vector<std::vector<float>> mArrays;
};

// Parses and validates `fc` against `specs`. Throws PluginError naming the field and the value. Build phase:
// absent optional fields take their defaults. Runtime phase (deserialization): every field must be present,
// because getFieldsToSerialize wrote them all; an absent one means truncated or corrupt plugin data.
FieldValues parseFields(std::vector<FieldSpec> const& specs, nvinfer1::PluginFieldCollection const* fc,
                        nvinfer1::TensorRTPhase phase, char const* pluginName);

// A PluginFieldCollection over storage it owns. Two uses: the creator's getFieldNames (names and types, no data)
// and a plugin's getFieldsToSerialize (every field with its value). Pointers stay valid for the object's
// lifetime; it cannot be copied or moved (TensorRT keeps the pointers).
class FieldCollection {
public:
    explicit FieldCollection(std::vector<FieldSpec> const& specs);  // names and types only
    explicit FieldCollection(FieldValues const& values);            // names, types and values (empty arrays left out)
    FieldCollection(FieldCollection const&) = delete;
    FieldCollection& operator=(FieldCollection const&) = delete;

    nvinfer1::PluginFieldCollection const* get() const { return &mCollection; }

private:
    void build(std::vector<FieldSpec> const& specs, FieldValues const* values);

    std::vector<int32_t> mInts;
    std::vector<float> mFloats;
    std::vector<std::vector<float>> mArrays;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{};
};

char const* fieldTypeName(nvinfer1::PluginFieldType type);
char const* phaseName(nvinfer1::TensorRTPhase phase);

}  // namespace plugin
}  // namespace pagedkv
