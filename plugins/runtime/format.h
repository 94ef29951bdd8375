// Message building for the KV manager's errors: cat(a, b, ...) streams its arguments into one string.
#pragma once

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

}  // namespace pagedkv::runtime
