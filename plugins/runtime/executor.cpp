// What every executor shares (executor.h): the step-shape checks against an engine's limits, the
// kv_write_status check, and the HostExecutor.
#include "pagedkv/runtime/executor.h"

#include <algorithm>
#include <stdexcept>

#include "format.h"
#include "pagedkv/engine_io.h"
#include "pagedkv/step_metadata.h"

namespace pagedkv::runtime {

Executor::~Executor() = default;

KVWriteError::KVWriteError(std::string const& message, int32_t layer, int32_t flags, int32_t seq, int32_t page,
                           int32_t entry)
    : std::runtime_error(message), layer(layer), flags(flags), seq(seq), page(page), entry(entry) {}
KVWriteError::~KVWriteError() = default;

void raiseForStatus(int32_t const* records, int32_t numLayers) {
    for (int32_t i = 0; i < numLayers; ++i) {
        int32_t const* s = records + int64_t(i) * kStatusFields;
        int32_t const flags = s[kStatusFlags];
        if (!flags) continue;
        int32_t const seq = s[kStatusSeq], page = s[kStatusPageInSeq], entry = s[kStatusEntry];
        std::string reasons;
        auto add = [&reasons](std::string const& r) { reasons += (reasons.empty() ? "" : "; ") + r; };
        if (flags & kStatusInvalidBlock)
            add(cat("block_table[", seq, "][", page, "] = ", entry, " is the invalid-page sentinel ", kInvalidBlock));
        if (flags & kStatusBlockOutOfRange) add(cat("block_table[", seq, "][", page, "] = ", entry, " is outside the pool"));
        if (flags & kStatusPastBlockTable) add(cat("sequence ", seq, " needs page ", page, ", past the block table's width"));
        throw KVWriteError(cat(engine_io::kKvWriteStatusPrefix, i, ": ", reasons, " (tokens there were skipped)"), i, flags,
                           seq, page, entry);
    }
}

void fitShape(StepShape& shape, StepLimits const& limits, ModelInfo const& model, int32_t decodeWidth) {
    auto check = [](char const* input, int32_t value, int32_t limit, char const* what, char const* flag) {
        if (limit > 0 && value > limit)
            throw std::length_error(cat(input, ": a step of ", value, " ", what, " exceeds the engine profile's maximum of ",
                                        limit, "; rebuild the engine with a larger ", flag));
    };
    check(engine_io::kInputIds, shape.numTokens, limits.maxTokens, "tokens", "--max-tokens");
    check(engine_io::kPastLens, shape.numSeqs, limits.maxSeqs, "sequences", "--max-seqs");
    check(engine_io::kLogitsRows, shape.numRows, limits.maxRows, "logits rows", "--max-tokens");
    check(engine_io::kPenaltyTokens, shape.penaltyWidth, limits.maxPenaltyWidth, "penalty tokens per row",
          "--max-penalty-tokens");
    size_t const G = shape.maxBlocks.size();
    shape.tableWidth.resize(G);
    for (size_t g = 0; g < G; ++g) {
        int32_t const mb = shape.maxBlocks[g];
        std::string const name = cat(engine_io::kBlockTablePrefix, g);
        if (model.staticMaxBlocks > 0) {
            if (mb > model.staticMaxBlocks)
                throw std::length_error(cat(name, ": ", mb, " pages exceed the graph's static width max_blocks=",
                                            model.staticMaxBlocks));
            shape.tableWidth[g] = model.staticMaxBlocks;
            continue;
        }
        int32_t const width = shape.decodeOnly && decodeWidth > 0 ? std::max(decodeWidth, mb) : mb;
        check(name.c_str(), width, g < limits.maxBlocks.size() ? limits.maxBlocks[g] : 0, "pages per sequence",
              "--max-blocks");
        shape.tableWidth[g] = width;
    }
}

// ---- HostExecutor ------------------------------------------------------------------------------------
HostExecutor::HostExecutor(KVManager kv, ModelInfo model, HostStepFunction function, StepLimits limits)
    : kv_(std::move(kv)), model_(model), function_(std::move(function)), limits_(std::move(limits)) {
    if (model_.vocab < 1) throw std::invalid_argument(cat("vocab: must be >= 1, got ", model_.vocab));
}

StepInputBuffers const& HostExecutor::layout(StepShape& shape) {
    fitShape(shape, limits_, model_);
    int32_t const B = shape.numSeqs, T = shape.numTokens, R = shape.numRows, W = shape.penaltyWidth;
    inputIds_.resize(T);
    cuQLens_.resize(B + 1);
    pastLens_.resize(B);
    tables_.resize(shape.tableWidth.size());
    buffers_.blockTables.resize(tables_.size());
    for (size_t g = 0; g < tables_.size(); ++g) {
        tables_[g].resize(size_t(B) * shape.tableWidth[g]);
        buffers_.blockTables[g] = tables_[g].data();
    }
    positionIds_.resize(model_.explicitPositions ? T : 0);
    logitsRows_.resize(R);
    samplingParams_.resize(size_t(R) * engine_io::kSamplingFields);
    penaltyTokens_.resize(size_t(R) * W);
    penaltyCounts_.resize(size_t(R) * W);
    buffers_.inputIds = inputIds_.data();
    buffers_.cuQLens = cuQLens_.data();
    buffers_.pastLens = pastLens_.data();
    buffers_.positionIds = model_.explicitPositions ? positionIds_.data() : nullptr;
    buffers_.logitsRows = logitsRows_.data();
    buffers_.samplingParams = samplingParams_.data();
    buffers_.penaltyTokens = penaltyTokens_.data();
    buffers_.penaltyCounts = penaltyCounts_.data();
    return buffers_;
}

StepOutputs HostExecutor::execute(StepShape const& shape) {
    if (!function_)
        throw std::logic_error("HostExecutor: no step function; run the step between Engine::beginStep and endStep");
    copies_ = kv_.drainCopies();  // (no memory here: a device executor runs them before the step)
    size_t const R = size_t(shape.numRows), N = size_t(model_.numTopLogprobs);
    tokens_.assign(R, 0);
    logprobs_.assign(R, 0.f);
    topTokens_.assign(R * N, 0);
    topLogprobs_.assign(R * N, 0.f);
    function_(HostStep{shape, buffers_}, tokens_, logprobs_, topTokens_, topLogprobs_);
    return {tokens_.data(), logprobs_.data(), topTokens_.data(), topLogprobs_.data(), model_.numTopLogprobs};
}

}  // namespace pagedkv::runtime
