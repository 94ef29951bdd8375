// The test registry's runner (check.h).
#include "check.h"

namespace pagedkv::runtime::check {

namespace {
int currentFailures = 0;
}

std::vector<TestCase>& registry() {
    static std::vector<TestCase> cases;
    return cases;
}

void recordFailure(char const* file, int line, std::string const& what) {
    ++currentFailures;
    std::cout << "  " << file << ":" << line << ": " << what << "\n";
}

int failuresInCurrent() { return currentFailures; }

int runAll(std::string const& filter) {
    int passed = 0, failed = 0;
    for (TestCase const& t : registry()) {
        if (!filter.empty() && t.name.find(filter) == std::string::npos) continue;
        currentFailures = 0;
        try {
            t.body();
        } catch (std::exception const& e) {
            recordFailure(t.name.c_str(), 0, std::string("unexpected exception: ") + e.what());
        }
        std::cout << (currentFailures ? "FAIL " : "ok   ") << t.name << "\n";
        (currentFailures ? failed : passed) += 1;
    }
    std::cout << passed << " passed, " << failed << " failed" << std::endl;
    return failed ? 1 : 0;
}

}  // namespace pagedkv::runtime::check
