// sizing.h: Python's blocks_for_budget and budget_from_free_memory.
#include "pagedkv/runtime/sizing.h"

#include <cmath>

#include "format.h"

namespace pagedkv::runtime {

std::vector<int64_t> blocksForBudget(std::vector<PoolGroup> const& groups, int64_t budgetBytes,
                                     std::vector<double> const& shares) {
    auto bad = [](std::string const& m) { return KVArgumentError(m, std::nullopt); };
    if (budgetBytes < 0) throw bad(cat("budget_bytes: must be >= 0, got ", budgetBytes));
    if (groups.empty()) throw bad("groups: at least one pool group is needed");
    std::vector<int64_t> counts;
    if (shares.empty()) {
        int64_t sum = 0;
        for (PoolGroup const& g : groups) sum += g.blockBytes();
        counts.assign(groups.size(), budgetBytes / sum);
    } else {
        if (shares.size() != groups.size())
            throw bad(cat("shares: expected ", groups.size(), " values (one per group), got ", shares.size()));
        double total = 0;
        bool valid = true;
        for (double s : shares) {
            valid = valid && std::isfinite(s) && s >= 0;
            total += s;
        }
        if (!valid || std::fabs(total - 1.0) > 1e-9 * std::max(1.0, std::fabs(total))) {  // math.isclose
            std::vector<std::string> text;
            for (double s : shares) text.push_back(pyFloat(s));
            std::string list = "[";
            for (size_t i = 0; i < text.size(); ++i) list += (i ? ", " : "") + text[i];
            throw bad(cat("shares: must be >= 0 and sum to 1, got ", list, "]"));
        }
        for (size_t g = 0; g < groups.size(); ++g)
            counts.push_back(int64_t(std::floor(double(budgetBytes) * shares[g] / double(groups[g].blockBytes()))));
    }
    for (size_t g = 0; g < groups.size(); ++g)
        if (counts[g] <= 0)
            throw bad(cat("budget of ", budgetBytes, " bytes leaves no block for pool group ", quoted(groups[g].name),
                          " (one block is ", groups[g].blockBytes(), " bytes)"));
    return counts;
}

int64_t budgetFromFreeMemory(double fraction, int64_t freeBytes) {
    if (!(fraction > 0.0 && fraction <= 1.0))
        throw KVArgumentError(cat("memory_fraction: expected in (0, 1], got ", pyFloat(fraction)), std::nullopt);
    return int64_t(std::floor(double(freeBytes) * fraction));
}

}  // namespace pagedkv::runtime
