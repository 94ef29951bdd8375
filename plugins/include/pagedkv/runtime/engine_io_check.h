// Checking an engine's tensors against the engine-I/O contract (engine_io.h, docs/engine_io.md), host only:
// the TensorRT executor lists the deserialized engine's tensors and calls checkEngineIO before its first step;
// tests/test_runtime_native.py feeds it the tensors of rewritten graphs (and broken copies of them).
//
// An engine built from a rewritten graph has exactly the contract's tensors: every name (a family once per
// pool group g / layer i, indices 0..n-1), the listed direction, dtype (`model float`: FLOAT, HALF or BF16),
// rank and static dims. What the engine computes is read off the tensors: the pool groups (block_table_{g}), the
// layers (kv_write_status_{i}), explicit positions (position_ids), the sampling head (next_tokens ...), the
// vocabulary and the top-logprobs count (static dims), a static block-table width.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "pagedkv/runtime/executor.h"

namespace pagedkv::runtime {

enum class TensorType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kInt32 = 3, kInt64 = 4, kOther = 5 };
char const* tensorTypeName(TensorType type);  // "FLOAT", "HALF", "BF16", "INT32", "INT64", "other"

// One engine tensor; dims < 0 are dynamic (the profile's range applies).
struct EngineTensor {
    std::string name;
    bool isInput = false;
    TensorType type = TensorType::kOther;
    std::vector<int64_t> dims;
};

// The engine's I/O does not match the contract (or its deploy config): the message names every difference.
class EngineMismatchError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
    ~EngineMismatchError() override;
};

struct EngineIO {
    ModelInfo model;           // vocab, top logprobs, explicit positions, static width, layers
    int32_t numPoolGroups = 0;
    bool sampling = false;     // the sampling head is there
    TensorType logitsType = TensorType::kOther;
};

// Throws EngineMismatchError naming each difference: a tensor outside the contract, a missing one, a wrong
// direction, dtype, rank or static dim, a family with a gap, `numPoolGroups` (the deploy config's count;
// < 0: not checked) different from the engine's, an engine without the sampling head (the C++ runtime samples
// on the device only). `what` names the engine in the message.
EngineIO checkEngineIO(std::vector<EngineTensor> const& tensors, int32_t numPoolGroups, std::string const& what);

}  // namespace pagedkv::runtime
