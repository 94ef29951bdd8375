#include "json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace testhost {

Json::Json(double v) : mKind(Kind::kNumber), mNumber(v) {
    if (std::isnan(v)) {
        mText = "NaN";  // Python's json module reads NaN / Infinity
    } else if (std::isinf(v)) {
        mText = v > 0 ? "Infinity" : "-Infinity";
    } else {
        char buf[64];
        std::snprintf(buf, sizeof(buf), "%.9g", v);
        mText = buf;
        if (mText.find_first_of(".eE") == std::string::npos) mText += ".0";  // stays a float when read back
    }
}

bool Json::isInteger() const {
    return mKind == Kind::kNumber && mText.find_first_of(".eEIN") == std::string::npos;
}

bool Json::asBool() const {
    if (mKind != Kind::kBool) throw std::runtime_error("JSON: expected a boolean");
    return mBool;
}

int64_t Json::asInt() const {
    if (!isInteger()) throw std::runtime_error("JSON: expected an integer, got " + dump());
    return std::strtoll(mText.c_str(), nullptr, 10);
}

double Json::asDouble() const {
    if (mKind != Kind::kNumber) throw std::runtime_error("JSON: expected a number, got " + dump());
    return mNumber;
}

std::string const& Json::asString() const {
    if (mKind != Kind::kString) throw std::runtime_error("JSON: expected a string, got " + dump());
    return mString;
}

std::vector<Json> const& Json::items() const {
    if (mKind != Kind::kArray) throw std::runtime_error("JSON: expected an array, got " + dump());
    return mArray;
}

std::vector<std::pair<std::string, Json>> const& Json::members() const {
    if (mKind != Kind::kObject) throw std::runtime_error("JSON: expected an object, got " + dump());
    return mObject;
}

Json const* Json::find(std::string const& key) const {
    if (mKind != Kind::kObject) return nullptr;
    for (auto const& m : mObject) {
        if (m.first == key) return &m.second;
    }
    return nullptr;
}

Json const& Json::at(std::string const& key) const {
    Json const* j = find(key);
    if (j == nullptr) throw std::runtime_error("JSON: missing key '" + key + "'");
    return *j;
}

Json& Json::set(std::string const& key, Json value) {
    if (mKind == Kind::kNull) mKind = Kind::kObject;
    if (mKind != Kind::kObject) throw std::runtime_error("JSON: set on a non-object");
    for (auto& m : mObject) {
        if (m.first == key) {
            m.second = std::move(value);
            return *this;
        }
    }
    mObject.emplace_back(key, std::move(value));
    return *this;
}

Json& Json::push(Json value) {
    if (mKind == Kind::kNull) mKind = Kind::kArray;
    if (mKind != Kind::kArray) throw std::runtime_error("JSON: push on a non-array");
    mArray.push_back(std::move(value));
    return *this;
}

size_t Json::size() const {
    return mKind == Kind::kArray ? mArray.size() : mKind == Kind::kObject ? mObject.size() : 0;
}

namespace {

void dumpString(std::ostringstream& os, std::string const& s) {
    os << '"';
    for (unsigned char c : s) {
        switch (c) {
            case '"': os << "\\\""; break;
            case '\\': os << "\\\\"; break;
            case '\n': os << "\\n"; break;
            case '\r': os << "\\r"; break;
            case '\t': os << "\\t"; break;
            default:
                if (c < 0x20) {
                    char buf[8];
                    std::snprintf(buf, sizeof(buf), "\\u%04x", c);
                    os << buf;
                } else {
                    os << c;
                }
        }
    }
    os << '"';
}

void dumpValue(std::ostringstream& os, Json const& j) {
    switch (j.kind()) {
        case Json::Kind::kNull: os << "null"; break;
        case Json::Kind::kBool: os << (j.asBool() ? "true" : "false"); break;
        case Json::Kind::kNumber: os << j.dump(); break;
        case Json::Kind::kString: dumpString(os, j.asString()); break;
        case Json::Kind::kArray: {
            os << '[';
            bool first = true;
            for (Json const& item : j.items()) {
                if (!first) os << ',';
                first = false;
                dumpValue(os, item);
            }
            os << ']';
            break;
        }
        case Json::Kind::kObject: {
            os << '{';
            bool first = true;
            for (auto const& m : j.members()) {
                if (!first) os << ',';
                first = false;
                dumpString(os, m.first);
                os << ':';
                dumpValue(os, m.second);
            }
            os << '}';
            break;
        }
    }
}

}  // namespace

std::string Json::dump() const {
    if (mKind == Kind::kNumber) return mText;
    std::ostringstream os;
    dumpValue(os, *this);
    return os.str();
}

// ---- parser --------------------------------------------------------------------------------------------------

class JsonParser {
public:
    explicit JsonParser(std::string const& text) : mText(text) {}

    Json parseDocument() {
        Json j = parseValue();
        skipSpace();
        if (mPos != mText.size()) fail("trailing characters");
        return j;
    }

private:
    [[noreturn]] void fail(char const* what) const {
        throw std::runtime_error(std::string("JSON parse error at offset ") + std::to_string(mPos) + ": " + what);
    }
    void skipSpace() {
        while (mPos < mText.size() && (mText[mPos] == ' ' || mText[mPos] == '\n' || mText[mPos] == '\r' ||
                                       mText[mPos] == '\t')) {
            ++mPos;
        }
    }
    bool consume(char const* word) {
        size_t n = std::char_traits<char>::length(word);
        if (mText.compare(mPos, n, word) == 0) {
            mPos += n;
            return true;
        }
        return false;
    }
    Json parseValue() {
        skipSpace();
        if (mPos >= mText.size()) fail("unexpected end");
        char c = mText[mPos];
        if (c == '{') return parseObject();
        if (c == '[') return parseArray();
        if (c == '"') return Json(parseString());
        if (consume("true")) return Json(true);
        if (consume("false")) return Json(false);
        if (consume("null")) return Json();
        return parseNumber();
    }
    Json parseNumber() {
        size_t start = mPos;
        if (consume("NaN")) return numberFrom(start, std::nan(""));
        if (consume("Infinity")) return numberFrom(start, INFINITY);
        if (consume("-Infinity")) return numberFrom(start, -INFINITY);
        while (mPos < mText.size() && (std::isdigit(static_cast<unsigned char>(mText[mPos])) || mText[mPos] == '-' ||
                                       mText[mPos] == '+' || mText[mPos] == '.' || mText[mPos] == 'e' ||
                                       mText[mPos] == 'E')) {
            ++mPos;
        }
        if (mPos == start) fail("unexpected character");
        std::string text = mText.substr(start, mPos - start);
        char* end = nullptr;
        double v = std::strtod(text.c_str(), &end);
        if (end == nullptr || *end != '\0') fail("bad number");
        return numberFrom(start, v);
    }
    Json numberFrom(size_t start, double v) {
        Json j;
        j.mKind = Json::Kind::kNumber;
        j.mNumber = v;
        j.mText = mText.substr(start, mPos - start);
        return j;
    }
    std::string parseString() {
        ++mPos;  // opening quote
        std::string out;
        while (true) {
            if (mPos >= mText.size()) fail("unterminated string");
            char c = mText[mPos++];
            if (c == '"') break;
            if (c != '\\') {
                out += c;
                continue;
            }
            if (mPos >= mText.size()) fail("bad escape");
            char e = mText[mPos++];
            switch (e) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'u': {
                    if (mPos + 4 > mText.size()) fail("bad \\u escape");
                    unsigned code = std::stoul(mText.substr(mPos, 4), nullptr, 16);
                    mPos += 4;
                    if (code < 0x80) {
                        out += static_cast<char>(code);
                    } else if (code < 0x800) {
                        out += static_cast<char>(0xC0 | (code >> 6));
                        out += static_cast<char>(0x80 | (code & 0x3F));
                    } else {
                        out += static_cast<char>(0xE0 | (code >> 12));
                        out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
                        out += static_cast<char>(0x80 | (code & 0x3F));
                    }
                    break;
                }
                default: fail("bad escape");
            }
        }
        return out;
    }
    Json parseArray() {
        ++mPos;
        Json j = Json::array();
        skipSpace();
        if (mPos < mText.size() && mText[mPos] == ']') {
            ++mPos;
            return j;
        }
        while (true) {
            j.mArray.push_back(parseValue());
            skipSpace();
            if (mPos >= mText.size()) fail("unterminated array");
            char c = mText[mPos++];
            if (c == ']') return j;
            if (c != ',') fail("expected ',' or ']'");
        }
    }
    Json parseObject() {
        ++mPos;
        Json j = Json::object();
        skipSpace();
        if (mPos < mText.size() && mText[mPos] == '}') {
            ++mPos;
            return j;
        }
        while (true) {
            skipSpace();
            if (mPos >= mText.size() || mText[mPos] != '"') fail("expected a key");
            std::string key = parseString();
            skipSpace();
            if (mPos >= mText.size() || mText[mPos++] != ':') fail("expected ':'");
            j.mObject.emplace_back(std::move(key), parseValue());
            skipSpace();
            if (mPos >= mText.size()) fail("unterminated object");
            char c = mText[mPos++];
            if (c == '}') return j;
            if (c != ',') fail("expected ',' or '}'");
        }
    }

    std::string const& mText;
    size_t mPos = 0;
};

Json Json::parse(std::string const& text) { return JsonParser(text).parseDocument(); }

std::string readFile(std::string const& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + path);
    std::ostringstream os;
    os << in.rdbuf();
    return os.str();
}

}  // namespace testhost
