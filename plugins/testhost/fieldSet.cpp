#include "fieldSet.h"

#include <cstring>
#include <stdexcept>

namespace testhost {

using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;

namespace {

struct TypeName {
    PluginFieldType type;
    char const* name;
};
constexpr TypeName kTypeNames[] = {
    {PluginFieldType::kFLOAT16, "kFLOAT16"}, {PluginFieldType::kFLOAT32, "kFLOAT32"},
    {PluginFieldType::kFLOAT64, "kFLOAT64"}, {PluginFieldType::kINT8, "kINT8"},
    {PluginFieldType::kINT16, "kINT16"},     {PluginFieldType::kINT32, "kINT32"},
    {PluginFieldType::kCHAR, "kCHAR"},       {PluginFieldType::kDIMS, "kDIMS"},
    {PluginFieldType::kUNKNOWN, "kUNKNOWN"}, {PluginFieldType::kBF16, "kBF16"},
    {PluginFieldType::kINT64, "kINT64"},     {PluginFieldType::kFP8, "kFP8"},
    {PluginFieldType::kINT4, "kINT4"},       {PluginFieldType::kFP4, "kFP4"},
};

// After a blob's count: bytes TensorRT-RTX's plans hold there (zeros or an unexplained value), skipped.
constexpr size_t kBlobReservedBytes = 8;

// Raw fields larger than this are refused by the host (a fuzzed length must not make the host allocate gigabytes).
constexpr int64_t kMaxFieldBytes = int64_t(1) << 24;

bool allIntegers(Json const& list) {
    for (Json const& v : list.items()) {
        if (!v.isInteger()) return false;
    }
    return true;
}

}  // namespace

char const* fieldTypeName(PluginFieldType type) {
    for (TypeName const& t : kTypeNames) {
        if (t.type == type) return t.name;
    }
    return "(unknown PluginFieldType)";
}

PluginFieldType fieldTypeFromName(std::string const& name) {
    for (TypeName const& t : kTypeNames) {
        if (name == t.name) return t.type;
    }
    throw std::runtime_error("unknown PluginFieldType name '" + name + "'");
}

int64_t fieldBytes(PluginFieldType type, int32_t length) {
    if (length < 0) return -1;
    switch (type) {
        case PluginFieldType::kFLOAT16:
        case PluginFieldType::kBF16:
        case PluginFieldType::kINT16: return 2 * int64_t(length);
        case PluginFieldType::kFLOAT32:
        case PluginFieldType::kINT32: return 4 * int64_t(length);
        case PluginFieldType::kFLOAT64:
        case PluginFieldType::kINT64: return 8 * int64_t(length);
        case PluginFieldType::kINT8:
        case PluginFieldType::kCHAR:
        case PluginFieldType::kUNKNOWN:
        case PluginFieldType::kFP8: return length;
        case PluginFieldType::kINT4:
        case PluginFieldType::kFP4: return (int64_t(length) + 1) / 2;
        case PluginFieldType::kDIMS: return int64_t(sizeof(nvinfer1::Dims)) * length;
    }
    return -1;
}

void FieldSet::add(std::string name, PluginFieldType type, int32_t length, void const* data, size_t bytes,
                   bool nullData, bool nullName) {
    Entry e{std::move(name), type, length, std::vector<uint64_t>((bytes + 7) / 8 + 1, 0), bytes, nullData, nullName};
    if (data != nullptr && bytes > 0) std::memcpy(e.storage.data(), data, bytes);
    mEntries.push_back(std::move(e));
}

void FieldSet::addOnnxAttribute(std::string const& name, Json const& value) {
    if (value.isInteger()) {  // INT: int64 in ONNX, truncated to int32 by the parser
        int32_t v = static_cast<int32_t>(value.asInt());
        add(name, PluginFieldType::kINT32, 1, &v, sizeof(v));
    } else if (value.isNumber()) {  // FLOAT
        float v = static_cast<float>(value.asDouble());
        add(name, PluginFieldType::kFLOAT32, 1, &v, sizeof(v));
    } else if (value.isString()) {  // STRING: kCHAR, NUL included
        std::string const& s = value.asString();
        add(name, PluginFieldType::kCHAR, static_cast<int32_t>(s.size() + 1), s.c_str(), s.size() + 1);
    } else if (value.isArray() && allIntegers(value)) {  // INTS
        std::vector<int32_t> v;
        for (Json const& item : value.items()) v.push_back(static_cast<int32_t>(item.asInt()));
        add(name, PluginFieldType::kINT32, static_cast<int32_t>(v.size()), v.data(), v.size() * sizeof(int32_t));
    } else if (value.isArray()) {  // FLOATS
        std::vector<float> v;
        for (Json const& item : value.items()) v.push_back(static_cast<float>(item.asDouble()));
        add(name, PluginFieldType::kFLOAT32, static_cast<int32_t>(v.size()), v.data(), v.size() * sizeof(float));
    } else {
        throw std::runtime_error("attribute '" + name + "': unsupported JSON value " + value.dump());
    }
}

void FieldSet::addRaw(std::string const& name, Json const& spec) {
    Json const& rawType = spec.at("raw_type");
    PluginFieldType const type = rawType.isInteger() ? static_cast<PluginFieldType>(rawType.asInt())
                                                     : fieldTypeFromName(rawType.asString());
    std::vector<uint8_t> bytes;
    int32_t count = 0;
    auto append = [&bytes](void const* p, size_t n) {
        auto const* b = static_cast<uint8_t const*>(p);
        bytes.insert(bytes.end(), b, b + n);
    };
    Json const* values = spec.find("values");
    if (values != nullptr && values->isString()) {
        std::string const& s = values->asString();
        append(s.c_str(), s.size() + 1);
        count = static_cast<int32_t>(s.size() + 1);
    } else if (values != nullptr) {
        for (Json const& v : values->items()) {
            switch (type) {
                case PluginFieldType::kINT8:
                case PluginFieldType::kCHAR:
                case PluginFieldType::kUNKNOWN:
                case PluginFieldType::kFP8: { int8_t x = static_cast<int8_t>(v.asInt()); append(&x, 1); break; }
                case PluginFieldType::kINT16: { int16_t x = static_cast<int16_t>(v.asInt()); append(&x, 2); break; }
                case PluginFieldType::kINT32: { int32_t x = static_cast<int32_t>(v.asInt()); append(&x, 4); break; }
                case PluginFieldType::kINT64: { int64_t x = v.asInt(); append(&x, 8); break; }
                case PluginFieldType::kFLOAT32: { float x = static_cast<float>(v.asDouble()); append(&x, 4); break; }
                case PluginFieldType::kFLOAT64: { double x = v.asDouble(); append(&x, 8); break; }
                default: throw std::runtime_error("raw field '" + name + "': no value encoding for this raw_type");
            }
            ++count;
        }
    }
    Json const* length = spec.find("length");
    int32_t const claimed = length != nullptr ? static_cast<int32_t>(length->asInt()) : count;
    bool const nullData = spec.has("null_data") && spec.at("null_data").asBool();
    bool const nullName = spec.has("null_name") && spec.at("null_name").asBool();
    // Storage covers the claimed length as well, so a plugin that trusts `length` reads zeros, not the heap.
    int64_t const claimedBytes = fieldBytes(type, claimed);
    if (claimedBytes > kMaxFieldBytes) throw std::runtime_error("raw field '" + name + "': claimed length too large");
    if (claimedBytes > static_cast<int64_t>(bytes.size())) bytes.resize(static_cast<size_t>(claimedBytes), 0);
    add(name, type, claimed, bytes.data(), bytes.size(), nullData, nullName);
}

FieldSet FieldSet::fromBlob(std::vector<uint8_t> const& blob) {
    FieldSet set;
    size_t at = 0;
    auto readU32 = [&](uint32_t& out) {
        if (blob.size() - at < 4) return false;
        std::memcpy(&out, blob.data() + at, 4);
        at += 4;
        return true;
    };
    uint32_t count = 0;
    if (!readU32(count) || blob.size() - at < kBlobReservedBytes) return set;
    at += kBlobReservedBytes;
    for (uint32_t i = 0; i < count; ++i) {
        uint32_t nameLength = 0, type = 0, length = 0;
        if (!readU32(nameLength) || blob.size() - at < nameLength) break;
        // A C string for the plugin: up to the first NUL, one added when the bytes hold none.
        std::string const name(reinterpret_cast<char const*>(blob.data() + at),
                               strnlen(reinterpret_cast<char const*>(blob.data() + at), nameLength));
        at += nameLength;
        if (!readU32(type) || !readU32(length)) break;
        auto const fieldType = static_cast<PluginFieldType>(type);
        int64_t const bytes = fieldBytes(fieldType, static_cast<int32_t>(length));
        // A type without a size, or data past the end: TensorRT would not hand such a field over.
        if (bytes < 0 || static_cast<uint64_t>(bytes) > blob.size() - at) break;
        set.add(name, fieldType, static_cast<int32_t>(length), blob.data() + at, static_cast<size_t>(bytes));
        at += static_cast<size_t>(bytes);
    }
    return set;
}

std::vector<uint8_t> FieldSet::toBlob() const {
    std::vector<uint8_t> out;
    auto putU32 = [&out](uint32_t v) {
        uint8_t b[4];
        std::memcpy(b, &v, 4);
        out.insert(out.end(), b, b + 4);
    };
    putU32(static_cast<uint32_t>(mEntries.size()));
    out.insert(out.end(), kBlobReservedBytes, 0);
    for (Entry const& e : mEntries) {
        putU32(static_cast<uint32_t>(e.name.size() + 1));
        out.insert(out.end(), e.name.begin(), e.name.end());
        out.push_back(0);
        putU32(static_cast<uint32_t>(e.type));
        putU32(static_cast<uint32_t>(e.length));
        auto const* data = reinterpret_cast<uint8_t const*>(e.storage.data());
        out.insert(out.end(), data, data + e.bytes);
    }
    return out;
}

FieldSet FieldSet::fromOnnxAttributes(Json const& attrs, PluginFieldCollection const* fieldNames) {
    FieldSet set;
    for (int32_t i = 0; fieldNames != nullptr && i < fieldNames->nbFields; ++i) {
        char const* name = fieldNames->fields[i].name;
        if (name == nullptr) continue;
        if (Json const* value = attrs.find(name)) set.addOnnxAttribute(name, *value);
    }
    return set;
}

FieldSet FieldSet::direct(Json const& attrs) {
    FieldSet set;
    for (auto const& m : attrs.members()) {
        if (m.second.isObject()) {
            set.addRaw(m.first, m.second);
        } else {
            set.addOnnxAttribute(m.first, m.second);
        }
    }
    return set;
}

FieldSet FieldSet::copyOf(PluginFieldCollection const* fc) {
    FieldSet set;
    if (fc == nullptr) throw std::runtime_error("getFieldsToSerialize returned null");
    for (int32_t i = 0; i < fc->nbFields; ++i) {
        PluginField const& f = fc->fields[i];
        int64_t const bytes = fieldBytes(f.type, f.length);
        if (f.name == nullptr || bytes < 0) {
            throw std::runtime_error("serialized field #" + std::to_string(i) + " has no name or an unsized type");
        }
        set.add(f.name, f.type, f.length, f.data, f.data ? static_cast<size_t>(bytes) : 0, f.data == nullptr);
    }
    return set;
}

PluginFieldCollection const* FieldSet::get() {
    mFields.clear();
    for (Entry const& e : mEntries) {
        mFields.emplace_back(e.nullName ? nullptr : e.name.c_str(), e.nullData ? nullptr : e.storage.data(), e.type,
                             e.length);
    }
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
    return &mCollection;
}

Json FieldSet::describe() const {
    Json out = Json::object();
    for (Entry const& e : mEntries) {
        Json d = Json::object().set("type", fieldTypeName(e.type)).set("length", e.length);
        Json values = Json::array();
        if (e.nullData) {
            d.set("value", Json());
            out.set(e.name, d);
            continue;
        }
        auto const* p = reinterpret_cast<uint8_t const*>(e.storage.data());
        int32_t const n = e.length;
        if (e.type == PluginFieldType::kCHAR) {
            d.set("value", std::string(reinterpret_cast<char const*>(p), strnlen(reinterpret_cast<char const*>(p), e.bytes)));
            out.set(e.name, d);
            continue;
        }
        for (int32_t i = 0; i < n && fieldBytes(e.type, i + 1) <= static_cast<int64_t>(e.bytes); ++i) {
            switch (e.type) {
                case PluginFieldType::kINT32: { int32_t x; std::memcpy(&x, p + 4 * i, 4); values.push(Json(int64_t(x))); break; }
                case PluginFieldType::kINT64: { int64_t x; std::memcpy(&x, p + 8 * i, 8); values.push(Json(x)); break; }
                case PluginFieldType::kINT16: { int16_t x; std::memcpy(&x, p + 2 * i, 2); values.push(Json(int64_t(x))); break; }
                case PluginFieldType::kINT8: values.push(Json(int64_t(static_cast<int8_t>(p[i])))); break;
                case PluginFieldType::kFLOAT32: { float x; std::memcpy(&x, p + 4 * i, 4); values.push(Json(double(x))); break; }
                case PluginFieldType::kFLOAT64: { double x; std::memcpy(&x, p + 8 * i, 8); values.push(Json(x)); break; }
                default: values.push(Json(int64_t(p[i]))); break;  // bytes
            }
        }
        d.set("value", values.size() == 1 && n == 1 ? values.items()[0] : values);
        out.set(e.name, d);
    }
    return out;
}

bool FieldSet::sameAs(FieldSet const& other) const {
    if (mEntries.size() != other.mEntries.size()) return false;
    for (size_t i = 0; i < mEntries.size(); ++i) {
        Entry const& a = mEntries[i];
        Entry const& b = other.mEntries[i];
        if (a.name != b.name || a.type != b.type || a.length != b.length || a.nullData != b.nullData ||
            a.bytes != b.bytes || std::memcmp(a.storage.data(), b.storage.data(), a.bytes) != 0) {
            return false;
        }
    }
    return true;
}

}  // namespace testhost
