// A small JSON value for the test host's specs (input) and reports (output). Numbers keep their source text
// so that an ONNX INT attribute (no '.', 'e') is told apart from a FLOAT one, and 64-bit integers stay exact.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace testhost {

class Json {
public:
    enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };

    Json() = default;
    Json(bool v) : mKind(Kind::kBool), mBool(v) {}  // NOLINT: implicit by design, reports read naturally
    Json(int v) : Json(static_cast<int64_t>(v)) {}
    Json(int64_t v) : mKind(Kind::kNumber), mNumber(static_cast<double>(v)), mText(std::to_string(v)) {}
    Json(uint64_t v) : mKind(Kind::kNumber), mNumber(static_cast<double>(v)), mText(std::to_string(v)) {}
    Json(double v);
    Json(char const* v) : mKind(Kind::kString), mString(v) {}
    Json(std::string v) : mKind(Kind::kString), mString(std::move(v)) {}

    static Json array() { Json j; j.mKind = Kind::kArray; return j; }
    static Json object() { Json j; j.mKind = Kind::kObject; return j; }
    static Json parse(std::string const& text);  // throws std::runtime_error with the offset

    Kind kind() const { return mKind; }
    bool isNull() const { return mKind == Kind::kNull; }
    bool isNumber() const { return mKind == Kind::kNumber; }
    bool isInteger() const;  // a number written without '.', 'e', 'E', inf or nan
    bool isString() const { return mKind == Kind::kString; }
    bool isArray() const { return mKind == Kind::kArray; }
    bool isObject() const { return mKind == Kind::kObject; }

    bool asBool() const;
    int64_t asInt() const;  // exact for integers written in the source
    double asDouble() const;
    std::string const& asString() const;
    std::vector<Json> const& items() const;                             // array elements
    std::vector<std::pair<std::string, Json>> const& members() const;  // object members, in source order

    Json const* find(std::string const& key) const;  // nullptr when absent
    Json const& at(std::string const& key) const;    // throws naming the key
    bool has(std::string const& key) const { return find(key) != nullptr; }

    Json& set(std::string const& key, Json value);  // object: replaces or appends
    Json& push(Json value);                         // array
    size_t size() const;

    std::string dump() const;

private:
    Kind mKind = Kind::kNull;
    bool mBool = false;
    double mNumber = 0;
    std::string mText;  // numbers: source text
    std::string mString;
    std::vector<Json> mArray;
    std::vector<std::pair<std::string, Json>> mObject;

    friend class JsonParser;
};

std::string readFile(std::string const& path);  // throws when unreadable

}  // namespace testhost
