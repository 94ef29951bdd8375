// Error types and the message helpers shared by the KV manager's sources (kv_errors.h).
#include "pagedkv/runtime/kv_errors.h"

#include <cstdio>

#include "format.h"

namespace pagedkv::runtime {

char const* tierName(Tier tier) { return tier == Tier::kPrimary ? "primary" : "secondary"; }

std::string quoted(std::string const& name) {
    // Python's str.__repr__: single quotes unless the text holds ' and no ", escapes for the rest.
    bool single = name.find('\'') != std::string::npos;
    bool dbl = name.find('"') != std::string::npos;
    char quote = (single && !dbl) ? '"' : '\'';
    std::string out(1, quote);
    for (unsigned char c : name) {
        if (c == '\\' || c == static_cast<unsigned char>(quote)) {
            out += '\\';
            out += static_cast<char>(c);
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\r') {
            out += "\\r";
        } else if (c == '\t') {
            out += "\\t";
        } else if (c < 0x20 || c == 0x7f) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\x%02x", c);
            out += buf;
        } else {
            out += static_cast<char>(c);
        }
    }
    out += quote;
    return out;
}

namespace {

std::string exhaustedMessage(int64_t needed, int64_t free, std::string const& group, Tier tier,
                             std::optional<SeqId> seq, std::string const& what) {
    std::string who = seq ? cat("sequence ", *seq, " ") : std::string();
    std::string doing = what.empty() ? std::string() : cat(" (", what, ")");
    return cat("KV cache exhausted: ", who, "needs ", needed, " block(s) in pool group ", quoted(group), " (",
               tierName(tier), " tier)", doing, " but only ", free, " are free; nothing was changed");
}

std::string invariantMessage(std::string const& check, std::string const& detail, KVInvariantError::Where const& w,
                             std::string const& expected, std::string const& found) {
    std::string where;
    auto add = [&](std::string item) { where += (where.empty() ? "" : ", ") + item; };
    if (w.seq) add(cat("seq=", *w.seq));
    if (!w.group.empty()) add(cat("group=", quoted(w.group)));
    if (w.page) add(cat("page=", *w.page));
    if (w.block) add(cat("block=", *w.block));
    return cat("kv doctor: ", check, ": ", detail, where.empty() ? std::string() : cat(" [", where, "]"), ": expected ",
               expected, ", found ", found);
}

}  // namespace

KVCacheError::~KVCacheError() = default;
KVArgumentError::~KVArgumentError() = default;
UnknownSequenceError::~UnknownSequenceError() = default;
KVCacheExhaustedError::~KVCacheExhaustedError() = default;
BlockRefcountError::~BlockRefcountError() = default;
KVInvariantError::~KVInvariantError() = default;

KVCacheExhaustedError::KVCacheExhaustedError(int64_t needed, int64_t free, std::string group, Tier tier,
                                             std::optional<SeqId> seq, std::string operation)
    : KVCacheError(exhaustedMessage(needed, free, group, tier, seq, operation), seq),
      needed(needed),
      free(free),
      group(std::move(group)),
      tier(tier),
      operation(std::move(operation)) {}

KVInvariantError::KVInvariantError(std::string check, std::string detail, Where where, std::string expected,
                                   std::string found)
    : KVCacheError(invariantMessage(check, detail, where, expected, found), where.seq),
      check(std::move(check)),
      detail(std::move(detail)),
      group(std::move(where.group)),
      page(where.page),
      block(where.block),
      expected(std::move(expected)),
      found(std::move(found)) {}

}  // namespace pagedkv::runtime
