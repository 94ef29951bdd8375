// The C++ KV manager's error types: the twins of `pagedkv.kvcache.errors` (plus the ValueError / KeyError
// cases of the Python manager, which Python expresses with built-in exceptions).
//
// Every error names what it is about (sequence, pool group, tier, block) and the values involved; the
// messages are the Python manager's, word for word, so both runtimes report a failing step alike
// (tests/test_kvcache_native.py compares them). An operation that throws has changed nothing.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace pagedkv::runtime {

using SeqId = int64_t;

enum class Tier : int32_t {
    kPrimary = 0,    // the pool the kernels read and write
    kSecondary = 1,  // pinned host memory: offloaded blocks
};
char const* tierName(Tier tier);  // "primary" / "secondary"

// Base of every error the KV manager throws (each class's destructor is its key function: one vtable and
// type info, in the library, so that a caller catches them across the library boundary). `seq` names the sequence when
// the error is about one.
class KVCacheError : public std::runtime_error {
public:
    KVCacheError(std::string const& message, std::optional<SeqId> seq) : std::runtime_error(message), seq(seq) {}
    ~KVCacheError() override;
    std::optional<SeqId> seq;
};

// Bad argument or an operation the sequence's state does not allow (Python: ValueError).
class KVArgumentError : public KVCacheError {
public:
    using KVCacheError::KVCacheError;
    ~KVArgumentError() override;
};

// The sequence is not in the manager (Python: KeyError).
class UnknownSequenceError : public KVCacheError {
public:
    using KVCacheError::KVCacheError;
    ~UnknownSequenceError() override;
};

// Not enough free blocks for an operation; nothing was changed.
class KVCacheExhaustedError : public KVCacheError {
public:
    KVCacheExhaustedError(int64_t needed, int64_t free, std::string group, Tier tier, std::optional<SeqId> seq,
                          std::string operation);
    ~KVCacheExhaustedError() override;
    int64_t needed, free;
    std::string group;
    Tier tier;
    std::string operation;  // what ran out, e.g. "swap_in" (Python's `what`)
};

// A block released more often than it was held (double free).
class BlockRefcountError : public KVCacheError {
public:
    BlockRefcountError(std::string const& message, int32_t block, int32_t refcount)
        : KVCacheError(message, std::nullopt), block(block), refcount(refcount) {}
    ~BlockRefcountError() override;
    int32_t block, refcount;
};

// The validator ("kv doctor") found a violated invariant. Fields that do not apply are empty / nullopt.
class KVInvariantError : public KVCacheError {
public:
    struct Where {
        std::optional<SeqId> seq = std::nullopt;
        std::string group = {};
        std::optional<int32_t> page = std::nullopt;
        std::optional<int64_t> block = std::nullopt;
    };
    KVInvariantError(std::string check, std::string detail, Where where, std::string expected, std::string found);
    ~KVInvariantError() override;
    std::string check, detail;
    std::string group;
    std::optional<int32_t> page;
    std::optional<int64_t> block;
    std::string expected, found;
};

// Python's repr() of a pool group name ('name'), so that messages read exactly like the Python manager's.
std::string quoted(std::string const& name);

}  // namespace pagedkv::runtime
