// checkEngineIO (engine_io_check.h): an engine's tensors against engine_io.h's kTensors.
#include "pagedkv/runtime/engine_io_check.h"

#include <algorithm>
#include <map>
#include <set>

#include "format.h"
#include "pagedkv/engine_io.h"

namespace pagedkv::runtime {

EngineMismatchError::~EngineMismatchError() = default;

char const* tensorTypeName(TensorType type) {
    switch (type) {
        case TensorType::kFloat32: return "FLOAT";
        case TensorType::kFloat16: return "HALF";
        case TensorType::kBFloat16: return "BF16";
        case TensorType::kInt32: return "INT32";
        case TensorType::kInt64: return "INT64";
        case TensorType::kOther: return "other";
    }
    return "other";
}

namespace {

using engine_io::Dim;
using engine_io::DType;
using engine_io::Per;
using engine_io::Presence;
using engine_io::TensorSpec;

// The index of a family member ("block_table_" + "3" -> 3), or -1 (not a member, or a non-canonical number).
int32_t familyIndex(std::string const& name, char const* prefix) {
    std::string const p = prefix;
    if (name.size() <= p.size() || name.compare(0, p.size(), p) != 0) return -1;
    std::string const digits = name.substr(p.size());
    if (digits.size() > 6 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
        return -1;
    int32_t const i = std::stoi(digits);
    return std::to_string(i) == digits ? i : -1;
}

bool typeMatches(DType want, TensorType got) {
    switch (want) {
        case DType::kInt32: return got == TensorType::kInt32;
        case DType::kInt64: return got == TensorType::kInt64;
        case DType::kFloat32: return got == TensorType::kFloat32;
        case DType::kModelFloat:
            return got == TensorType::kFloat32 || got == TensorType::kFloat16 || got == TensorType::kBFloat16;
    }
    return false;
}

char const* typeText(DType want) {
    switch (want) {
        case DType::kInt32: return "INT32";
        case DType::kInt64: return "INT64";
        case DType::kFloat32: return "FLOAT";
        case DType::kModelFloat: return "FLOAT, HALF or BF16";
    }
    return "?";
}

std::string dimsText(std::vector<int64_t> const& dims) {
    std::string out = "[";
    for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + (dims[i] < 0 ? std::string("?") : std::to_string(dims[i]));
    return out + "]";
}

}  // namespace

EngineIO checkEngineIO(std::vector<EngineTensor> const& tensors, int32_t numPoolGroups, std::string const& what) {
    std::vector<std::string> problems;
    std::map<std::string, EngineTensor const*> byName;
    std::map<TensorSpec const*, std::set<int32_t>> members;  // family -> indices present
    for (EngineTensor const& t : tensors) {
        byName[t.name] = &t;
        bool known = false;
        for (TensorSpec const& spec : engine_io::kTensors) {
            if (spec.per == Per::kEngine ? t.name == spec.name : familyIndex(t.name, spec.name) >= 0) {
                known = true;
                if (spec.per != Per::kEngine) members[&spec].insert(familyIndex(t.name, spec.name));
                break;
            }
        }
        if (!known) problems.push_back(cat(t.name, ": not a tensor of the engine-I/O contract (engine_io.h)"));
    }
    auto count = [&](char const* prefix) {
        for (auto const& [spec, idx] : members)
            if (std::string(spec->name) == prefix) return idx.empty() ? 0 : *idx.rbegin() + 1;
        return 0;
    };
    EngineIO io;
    io.numPoolGroups = count(engine_io::kBlockTablePrefix);
    io.model.numLayers = count(engine_io::kKvWriteStatusPrefix);
    io.model.explicitPositions = byName.count(engine_io::kPositionIds) != 0;
    io.sampling = byName.count(engine_io::kNextTokens) || byName.count(engine_io::kSamplingParams);
    if (!io.numPoolGroups) problems.push_back(cat(engine_io::kBlockTablePrefix, "0: missing (no pool group)"));
    if (!io.model.numLayers) problems.push_back(cat(engine_io::kKvWriteStatusPrefix, "0: missing (no layer)"));
    for (TensorSpec const& spec : engine_io::kTensors) {
        bool const present = spec.presence == Presence::kAlways ||
                             (spec.presence == Presence::kExplicitPositions && io.model.explicitPositions) ||
                             (spec.presence == Presence::kSampling && io.sampling);
        if (!present) continue;
        int32_t const n = spec.per == Per::kEngine ? 1
                          : spec.per == Per::kPoolGroup ? io.numPoolGroups
                                                        : io.model.numLayers;
        for (int32_t i = 0; i < n; ++i) {
            std::string const name = spec.per == Per::kEngine ? spec.name : cat(spec.name, i);
            auto it = byName.find(name);
            if (it == byName.end()) {
                problems.push_back(cat(name, ": missing"));
                continue;
            }
            EngineTensor const& t = *it->second;
            if (t.isInput != spec.isInput)
                problems.push_back(cat(name, ": an ", t.isInput ? "input" : "output", ", expected an ",
                                       spec.isInput ? "input" : "output"));
            if (!typeMatches(spec.dtype, t.type))
                problems.push_back(cat(name, ": dtype ", tensorTypeName(t.type), ", expected ", typeText(spec.dtype)));
            if (int32_t(t.dims.size()) != spec.rank) {
                problems.push_back(cat(name, ": shape ", dimsText(t.dims), " of rank ", t.dims.size(), ", expected rank ",
                                       spec.rank));
                continue;
            }
            for (int32_t d = 0; d < spec.rank; ++d) {
                int64_t const got = t.dims[d];
                Dim const dim = spec.shape[d].dim;
                int64_t want = -2;  // -2: any
                if (dim == Dim::kStatic) want = spec.shape[d].value;
                if (dim == Dim::kNumPoolGroups) want = io.numPoolGroups;
                if ((dim == Dim::kVocab || dim == Dim::kNumTopLogprobs) && got < 0)
                    problems.push_back(cat(name, ": dim ", d, " (", dim == Dim::kVocab ? "vocab" : "num_top_logprobs",
                                           ") is dynamic, expected static"));
                if (dim == Dim::kVocab && got >= 0) io.model.vocab = int32_t(got);
                if (dim == Dim::kNumTopLogprobs && got >= 0) io.model.numTopLogprobs = int32_t(got);
                if (dim == Dim::kMaxBlocks && got > 0) io.model.staticMaxBlocks = int32_t(got);
                if (want != -2 && got != want)
                    problems.push_back(cat(name, ": shape ", dimsText(t.dims), ", expected dim ", d, " = ", want));
            }
            if (name == engine_io::kLogits) io.logitsType = t.type;
        }
    }
    if (!io.sampling)
        problems.push_back("no sampling head (next_tokens, sampling_params, ...): the graph was rewritten with "
                           "--no-sampling, and the C++ runtime samples on the device only; rewrite it without "
                           "--no-sampling");
    if (numPoolGroups >= 0 && io.numPoolGroups && numPoolGroups != io.numPoolGroups)
        problems.push_back(cat("the engine has ", io.numPoolGroups, " pool group(s) (block_table_0..", io.numPoolGroups - 1,
                               "), its deploy config ", numPoolGroups));
    if (!problems.empty()) {
        std::string message = what + " does not match the engine-I/O contract (engine_io.h): ";
        for (size_t i = 0; i < problems.size(); ++i) message += (i ? "; " : "") + problems[i];
        throw EngineMismatchError(message);
    }
    return io;
}

}  // namespace pagedkv::runtime
