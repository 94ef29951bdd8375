// pagedkv_runtime_check: the C++ runtime's own tests and benchmark.
//   unit   [--filter NAME]                       unit tests (check.h registry)
//   random [--ops N] [--seed S] [--steps K]      the stateful random test (>= 10^5 operations by default)
//   bench  [--seqs B] [--context N] [--page-size P] [--steps K] [--prefix 0|1]       the KV manager's step
//   bench-engine  (the same options)                                                 the engine's step
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <string>

#include "check.h"
#include "commands.h"

namespace {

int usage() {
    std::cerr
        << "usage: pagedkv_runtime_check unit [--filter NAME]\n"
           "       pagedkv_runtime_check random [--ops N] [--seed S] [--steps K]\n"
           "       pagedkv_runtime_check bench|bench-engine [--seqs B] [--context N] [--page-size P] [--steps K] "
           "[--prefix 0|1]\n";
    return 2;
}

}  // namespace

int main(int argc, char** argv) {
    using namespace pagedkv::runtime::check;
    if (argc < 2) return usage();
    std::string const command = argv[1];
    std::map<std::string, std::string> options;
    for (int i = 2; i < argc; i += 2) {
        if (i + 1 >= argc || std::strncmp(argv[i], "--", 2) != 0) return usage();
        options[argv[i] + 2] = argv[i + 1];
    }
    auto number = [&](char const* name, long long fallback) -> long long {
        auto it = options.find(name);
        if (it == options.end()) return fallback;
        char* end = nullptr;
        long long v = std::strtoll(it->second.c_str(), &end, 10);
        if (!end || *end || v < 0) {
            std::cerr << "--" << name << ": expected a non-negative integer, got '" << it->second << "'\n";
            std::exit(2);
        }
        return v;
    };
    if (command == "unit") return runAll(options.count("filter") ? options["filter"] : "");
    if (command == "random")
        return runRandom(number("ops", 100000), uint64_t(number("seed", 0)), int32_t(number("steps", 260)));
    if (command == "bench" || command == "bench-engine") {
        BenchOptions o;
        o.seqs = int32_t(number("seqs", o.seqs));
        o.context = int32_t(number("context", o.context));
        o.pageSize = int32_t(number("page-size", o.pageSize));
        o.steps = int32_t(number("steps", o.steps));
        o.prefixReuse = number("prefix", 0) != 0;
        if (o.seqs < 1 || o.pageSize < 1 || o.steps < 1) return usage();
        return command == "bench" ? runBench(o) : runEngineBench(o);
    }
    return usage();
}
