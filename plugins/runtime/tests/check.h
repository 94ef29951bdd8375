// A minimal test registry for the runtime's C++ checks (pagedkv_runtime_check unit): PKV_TEST registers a
// function, EXPECT* record a failure with file:line and go on, runAll prints one line per failure and the
// closing "N passed, N failed" line that tests/test_runtime_cpp.py reads.
#pragma once

#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace pagedkv::runtime::check {

struct TestCase {
    std::string name;
    std::function<void()> body;
};
std::vector<TestCase>& registry();
void recordFailure(char const* file, int line, std::string const& what);
int failuresInCurrent();

struct Registrar {
    Registrar(char const* name, std::function<void()> body) { registry().push_back({name, std::move(body)}); }
};

int runAll(std::string const& filter);

template <typename A, typename B>
void expectEq(A const& a, B const& b, char const* ea, char const* eb, char const* file, int line) {
    if (!(a == b)) {
        std::ostringstream out;
        out << ea << " == " << eb << " failed";
        if constexpr (std::is_arithmetic_v<A> && std::is_arithmetic_v<B>) out << ": " << a << " vs " << b;
        recordFailure(file, line, out.str());
    }
}

}  // namespace pagedkv::runtime::check

#define PKV_CONCAT2(a, b) a##b
#define PKV_CONCAT(a, b) PKV_CONCAT2(a, b)
#define PKV_TEST(name)                                                                     \
    static void name();                                                                    \
    static ::pagedkv::runtime::check::Registrar PKV_CONCAT(registrar_, name)(#name, name); \
    static void name()
#define EXPECT(cond) \
    ((cond) ? void() : ::pagedkv::runtime::check::recordFailure(__FILE__, __LINE__, "EXPECT(" #cond ") failed"))
#define EXPECT_EQ(a, b) ::pagedkv::runtime::check::expectEq((a), (b), #a, #b, __FILE__, __LINE__)
// `stmt` must throw `Type`; `then` (a block using `e`) checks the exception.
#define EXPECT_THROW_THEN(stmt, Type, then)                                                                        \
    do {                                                                                                           \
        bool thrown_ = false;                                                                                      \
        try {                                                                                                      \
            stmt;                                                                                                  \
        } catch (Type const& e) {                                                                                  \
            thrown_ = true;                                                                                        \
            then;                                                                                                  \
        }                                                                                                          \
        if (!thrown_) ::pagedkv::runtime::check::recordFailure(__FILE__, __LINE__, #stmt " did not throw " #Type); \
    } while (0)
#define EXPECT_THROW(stmt, Type) EXPECT_THROW_THEN(stmt, Type, (void)e)
