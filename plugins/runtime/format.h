// Message building for the KV manager's errors: cat(a, b, ...) streams its arguments into one string.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace pagedkv::runtime {

template <typename... Args>
std::string cat(Args const&... args) {
    std::ostringstream out;
    (out << ... << args);
    return out.str();
}

// Python's repr of a list of integers: [1, 2, 3].
template <typename T>
std::string listRepr(std::vector<T> const& values) {
    std::ostringstream out;
    out << '[';
    for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
    out << ']';
    return out.str();
}

// Python's "{:g}" of a number (bounds in messages: 0, 1, -2).
inline std::string pyNumber(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return buf;
}

// Python's repr() of a float closely enough for messages: the shortest digits that read back exactly, an
// integral value with ".0", nan and inf spelled as Python does.
inline std::string pyFloat(double v) {
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    char buf[40];
    for (int precision = 1; precision <= 17; ++precision) {
        std::snprintf(buf, sizeof buf, "%.*g", precision, v);
        if (std::strtod(buf, nullptr) == v) break;
    }
    std::string out = buf;
    if (out.find_first_of(".en") == std::string::npos) out += ".0";
    return out;
}

}  // namespace pagedkv::runtime
