// PluginFieldCollections the way their producers build them:
//  - fromOnnxAttributes: the TensorRT ONNX parser (onnx-tensorrt). Only names the creator lists in
//    getFieldNames are passed; INT/INTS -> kINT32 (64-bit values truncated), FLOAT/FLOATS -> kFLOAT32,
//    STRING -> kCHAR with the NUL counted in the length. plugin_version / plugin_namespace are consumed.
//    A JSON integer is an ONNX INT, a JSON number with '.', 'e' or NaN/Infinity is a FLOAT.
//  - direct: an application calling createPlugin itself: every attribute, same conversions, plus raw fields
//    {"raw_type": "kINT64" (or any integer, valid or not), "values": [...], "length": n, "null_data": true,
//     "null_name": true} to build malformed input.
//  - copyOf: a deep copy of what getFieldsToSerialize returned (what an engine stores).
//  - fromBlob / toBlob: the field collection as bytes, the way TensorRT-RTX 1.7 stores a plugin's fields in an
//    engine (read off built plans): u32 count, 8 bytes we do not interpret (toBlob writes zeros), then per field
//    u32 name length (NUL included), the name, u32 PluginFieldType, u32 length, the data (length elements of the
//    type). fromBlob decodes whatever bytes it is given as far as they hold complete fields, as a lenient reader
//    would, so that corrupt blobs reach the plugin.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "json.h"

namespace testhost {

class FieldSet {
public:
    static FieldSet fromOnnxAttributes(Json const& attrs, nvinfer1::PluginFieldCollection const* fieldNames);
    static FieldSet direct(Json const& attrs);
    static FieldSet copyOf(nvinfer1::PluginFieldCollection const* fc);
    static FieldSet fromBlob(std::vector<uint8_t> const& blob);
    std::vector<uint8_t> toBlob() const;

    // Valid until the FieldSet changes or is destroyed.
    nvinfer1::PluginFieldCollection const* get();
    // {"name": {"type": "kINT32", "length": 1, "value": 4}, ...} (value null when data is null)
    Json describe() const;
    bool sameAs(FieldSet const& other) const;  // names, types, lengths and bytes

private:
    struct Entry {
        std::string name;
        nvinfer1::PluginFieldType type;
        int32_t length;
        std::vector<uint64_t> storage;  // 8-byte aligned bytes
        size_t bytes;
        bool nullData;
        bool nullName;
    };
    void add(std::string name, nvinfer1::PluginFieldType type, int32_t length, void const* data, size_t bytes,
             bool nullData = false, bool nullName = false);
    void addOnnxAttribute(std::string const& name, Json const& value);
    void addRaw(std::string const& name, Json const& spec);

    std::vector<Entry> mEntries;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{};
};

// Bytes of `length` elements of `type` (kUNKNOWN: bytes); -1 for types without a defined size.
int64_t fieldBytes(nvinfer1::PluginFieldType type, int32_t length);
char const* fieldTypeName(nvinfer1::PluginFieldType type);
nvinfer1::PluginFieldType fieldTypeFromName(std::string const& name);  // throws

}  // namespace testhost
