// DeviceExecutor (device.h): the pools, the staged step arrays, decode padding and CUDA graphs that every device
// executor shares; the twin of the Python TrtExecutor's arenas, pad_decode_step and graph buckets.
#include <algorithm>
#include <stdexcept>

#include "pagedkv/engine_io.h"
#include "pagedkv/runtime/device.h"
#include "pagedkv/runtime/sizing.h"
#include "pagedkv/step_metadata.h"

namespace pagedkv::runtime {

namespace {

// The next power of two >= n, at most `cap` (and at least n): Python's _bucket.
int32_t bucket(int32_t n, int32_t cap) {
    int32_t p = 1;
    while (p < n) p <<= 1;
    return std::max(n, std::min(cap, p));
}

std::vector<int64_t> blocksFor(std::vector<PoolGroup> const& groups, DeviceOptions const& o) {
    if (!o.numBlocks.empty()) return o.numBlocks;
    size_t free = 0, total = 0;
    checkCuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return blocksForBudget(groups, budgetFromFreeMemory(o.kvMemoryFraction, int64_t(free)), o.shares);
}

}  // namespace

DeviceExecutor::DeviceExecutor(std::vector<PoolGroup> groups, ModelInfo model, StepLimits limits,
                               DeviceOptions const& options)
    : model_(model),
      limits_(std::move(limits)),
      kv_(groups, blocksFor(groups, options), options.hostBlocks, options.prefixReuse),
      graphs_(options.maxGraphs) {
    int32_t const G = int32_t(groups.size());
    if (limits_.maxTokens < 1 || limits_.maxSeqs < 1 || limits_.maxRows < 1 || limits_.maxPenaltyWidth < 1 ||
        int32_t(limits_.maxBlocks.size()) != G ||
        std::any_of(limits_.maxBlocks.begin(), limits_.maxBlocks.end(), [](int32_t b) { return b < 1; }))
        throw std::invalid_argument("device executor: the step limits must bound tokens, sequences, rows, penalty "
                                    "width and every group's block-table columns");
    try {
        checkCuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
        std::vector<int64_t> blocks, host;
        for (int32_t g = 0; g < G; ++g) {
            blocks.push_back(kv_.stats(g).numBlocks);
            host.push_back(kv_.stats(g).hostBlocks);
        }
        pools_ = std::make_unique<DevicePools>(groups, blocks, host, options.poison, stream_);
        // kv_pools: uploaded once, bound by address (the pools never move).
        std::vector<uint64_t> addresses;
        for (int32_t g = 0; g < G; ++g) addresses.push_back(pools_->address(g));
        std::vector<int64_t> rows(size_t(G) * kPoolDescFields);
        kv_.writePoolDescriptors(addresses.data(), rows.data());
        checkCuda(cudaMalloc(&kvPools_, rows.size() * sizeof(int64_t)), "cudaMalloc (kv_pools)");
        checkCuda(cudaMemcpy(kvPools_, rows.data(), rows.size() * sizeof(int64_t), cudaMemcpyHostToDevice),
                  "upload kv_pools");
        // The engine inputs in the order an engine lists them (engine_io.h), then the outputs read back.
        int64_t const T = limits_.maxTokens, B = limits_.maxSeqs, R = limits_.maxRows, W = limits_.maxPenaltyWidth;
        inSlot.inputIds = in_.declare(engine_io::kInputIds, 8 * T);
        inSlot.cuQLens = in_.declare(engine_io::kCuQLens, 4 * (B + 1));
        inSlot.pastLens = in_.declare(engine_io::kPastLens, 4 * B);
        for (int32_t g = 0; g < G; ++g) {
            int64_t const width = model_.staticMaxBlocks ? model_.staticMaxBlocks : limits_.maxBlocks[g];
            inSlot.blockTables.push_back(
                in_.declare(std::string(engine_io::kBlockTablePrefix) + std::to_string(g), 4 * B * width));
        }
        if (model_.explicitPositions) inSlot.positionIds = in_.declare(engine_io::kPositionIds, 4 * T);
        inSlot.logitsRows = in_.declare(engine_io::kLogitsRows, 4 * R);
        inSlot.samplingParams = in_.declare(engine_io::kSamplingParams, 4 * R * engine_io::kSamplingFields);
        inSlot.penaltyTokens = in_.declare(engine_io::kPenaltyTokens, 4 * R * W);
        inSlot.penaltyCounts = in_.declare(engine_io::kPenaltyCounts, 4 * R * W);
        int64_t const N = model_.numTopLogprobs;
        outSlot.nextTokens = out_.declare(engine_io::kNextTokens, 4 * R);
        outSlot.nextLogprobs = out_.declare(engine_io::kNextLogprobs, 4 * R);
        outSlot.topTokens = out_.declare(engine_io::kTopTokens, 4 * R * N);
        outSlot.topLogprobs = out_.declare(engine_io::kTopLogprobs, 4 * R * N);
        for (int32_t i = 0; i < model_.numLayers; ++i)
            outSlot.statuses.push_back(out_.declare(std::string(engine_io::kKvWriteStatusPrefix) + std::to_string(i),
                                                    4 * kStatusFields));
        in_.allocate();
        out_.allocate();
        // CUDA graphs: padding rows write into blocks of the executor's own sequence, taken now (a reservation
        // made later would go stale under the engine's step plan).
        if (options.cudaGraphs) {
            try {
                kv_.addSequence(kPadSequence, nullptr, 0);
                kv_.reserve(kPadSequence, limits_.maxSeqs);
                for (int32_t g = 0; g < G; ++g) padRows_.push_back(kv_.blockList(kPadSequence, g));
                graphsOn_ = true;
            } catch (KVCacheError const& e) {
                if (kv_.contains(kPadSequence)) kv_.free(kPadSequence);
                graphsOff_ = std::string("the padding rows of CUDA-graph buckets do not fit: ") + e.what();
            }
        } else {
            graphsOff_ = "turned off (DeviceOptions::cudaGraphs)";
        }
        checkCuda(cudaStreamSynchronize(stream_), "poison the KV pools");
    } catch (...) {
        if (kvPools_) cudaFree(kvPools_);
        if (stream_) cudaStreamDestroy(stream_);
        throw;
    }
}

DeviceExecutor::~DeviceExecutor() {
    if (stream_) cudaStreamSynchronize(stream_);
    graphs_.clear();
    if (kvPools_) cudaFree(kvPools_);
    pools_.reset();
    if (stream_) cudaStreamDestroy(stream_);
}

int64_t DeviceExecutor::heldBlocks(int32_t group) const {
    if (!graphsOn_) return 0;
    return int64_t(std::count_if(padRows_[group].begin(), padRows_[group].end(), [](int32_t b) { return b >= 0; }));
}

int32_t DeviceExecutor::decodeColumns(StepShape const& shape) const {
    if (model_.staticMaxBlocks) return model_.staticMaxBlocks;
    int32_t width = 0, cap = *std::min_element(limits_.maxBlocks.begin(), limits_.maxBlocks.end());
    for (size_t g = 0; g < shape.maxBlocks.size(); ++g)
        width = std::max({width, shape.maxBlocks[g], int32_t(padRows_[g].size())});
    return bucket(width, cap);
}

StepInputBuffers const& DeviceExecutor::layout(StepShape& shape) {
    bool const graph = graphsOn_ && shape.decodeOnly;
    fitShape(shape, limits_, model_, graph ? decodeColumns(shape) : 0);
    StepShape padded = shape;
    if (graph) padded.numSeqs = padded.numTokens = padded.numRows = bucket(shape.numSeqs, limits_.maxSeqs);
    packFor(padded);
    buffers_.inputIds = static_cast<int64_t*>(in_.host(inSlot.inputIds));
    buffers_.cuQLens = static_cast<int32_t*>(in_.host(inSlot.cuQLens));
    buffers_.pastLens = static_cast<int32_t*>(in_.host(inSlot.pastLens));
    buffers_.blockTables.clear();
    for (int32_t slot : inSlot.blockTables) buffers_.blockTables.push_back(static_cast<int32_t*>(in_.host(slot)));
    buffers_.positionIds = inSlot.positionIds >= 0 ? static_cast<int32_t*>(in_.host(inSlot.positionIds)) : nullptr;
    buffers_.logitsRows = static_cast<int32_t*>(in_.host(inSlot.logitsRows));
    buffers_.samplingParams = static_cast<float*>(in_.host(inSlot.samplingParams));
    buffers_.penaltyTokens = static_cast<int32_t*>(in_.host(inSlot.penaltyTokens));
    buffers_.penaltyCounts = static_cast<float*>(in_.host(inSlot.penaltyCounts));
    laidOut_ = shape;
    return buffers_;
}

void DeviceExecutor::packFor(StepShape const& s) {
    int64_t const T = s.numTokens, B = s.numSeqs, R = s.numRows, W = s.penaltyWidth;
    std::vector<int64_t> bytes(in_.slots(), 0);
    bytes[inSlot.inputIds] = 8 * T;
    bytes[inSlot.cuQLens] = 4 * (B + 1);
    bytes[inSlot.pastLens] = 4 * B;
    for (size_t g = 0; g < inSlot.blockTables.size(); ++g) bytes[inSlot.blockTables[g]] = 4 * B * s.tableWidth[g];
    if (inSlot.positionIds >= 0) bytes[inSlot.positionIds] = 4 * T;
    bytes[inSlot.logitsRows] = 4 * R;
    bytes[inSlot.samplingParams] = 4 * R * engine_io::kSamplingFields;
    bytes[inSlot.penaltyTokens] = bytes[inSlot.penaltyCounts] = 4 * R * W;
    in_.pack(bytes);
    int64_t const N = model_.numTopLogprobs;
    std::vector<int64_t> out(out_.slots(), 4 * kStatusFields);
    out[outSlot.nextTokens] = out[outSlot.nextLogprobs] = 4 * R;
    out[outSlot.topTokens] = out[outSlot.topLogprobs] = 4 * R * N;
    out_.pack(out);
}

void DeviceExecutor::padDecode(StepShape const& real, StepShape& run) {
    int32_t const B = real.numSeqs, Bp = bucket(B, limits_.maxSeqs), W = real.penaltyWidth;
    run.numSeqs = run.numTokens = run.numRows = Bp;
    StepInputBuffers const& in = buffers_;
    for (int32_t i = B; i < Bp; ++i) {  // padding row j = i - B: one token at position j, greedy, ignored
        int32_t const j = i - B;
        in.cuQLens[i + 1] = i + 1;
        in.pastLens[i] = j;
        in.inputIds[i] = 0;
        if (in.positionIds) in.positionIds[i] = j;
        in.logitsRows[i] = i;
        float* row = in.samplingParams + int64_t(i) * engine_io::kSamplingFields;
        std::fill(row, row + engine_io::kSamplingFields, 0.f);
        row[engine_io::kSamplingTopP] = 1.f;
        row[engine_io::kSamplingRepetitionPenalty] = 1.f;
        std::fill(in.penaltyTokens + int64_t(i) * W, in.penaltyTokens + int64_t(i + 1) * W, -1);
        std::fill(in.penaltyCounts + int64_t(i) * W, in.penaltyCounts + int64_t(i + 1) * W, 0.f);
        for (size_t g = 0; g < padRows_.size(); ++g) {
            int32_t* table = in.blockTables[g] + int64_t(i) * real.tableWidth[g];
            std::fill(table, table + real.tableWidth[g], kInvalidBlock);
            std::copy(padRows_[g].begin(), padRows_[g].end(), table);
        }
    }
}

StepOutputs DeviceExecutor::execute(StepShape const& shape) {
    pools_->run(kv_.drainCopies(), stream_);  // copy-on-write and swaps land before the step's writes
    StepShape run = shape;
    bool const graph = graphsOn_ && shape.decodeOnly;
    if (graph) padDecode(shape, run);
    in_.upload(stream_);
    setShapes(run);
    if (graph) {
        GraphCache::Key const key{run.numSeqs, run.tableWidth.empty() ? 0 : run.tableWidth[0], run.penaltyWidth};
        if (!graphs_.launch(key, stream_)) {
            enqueue(run);  // the first step of a bucket runs eagerly (engines settle after a shape change) ...
            graphs_.capture(key, stream_, [&] { enqueue(run); });  // ... and is captured for the next ones
        }
    } else {
        enqueue(run);
    }
    out_.download(stream_);
    checkCuda(cudaStreamSynchronize(stream_), "the step");  // the step's one sync: its tokens
    std::vector<int32_t> statuses;
    for (int32_t slot : outSlot.statuses) {
        int32_t const* s = static_cast<int32_t const*>(out_.host(slot));
        statuses.insert(statuses.end(), s, s + kStatusFields);
    }
    raiseForStatus(statuses.data(), int32_t(outSlot.statuses.size()));
    return results(run);
}

StepOutputs DeviceExecutor::results(StepShape const&) {
    return {static_cast<int32_t const*>(out_.host(outSlot.nextTokens)),
            static_cast<float const*>(out_.host(outSlot.nextLogprobs)),
            static_cast<int32_t const*>(out_.host(outSlot.topTokens)),
            static_cast<float const*>(out_.host(outSlot.topLogprobs)), model_.numTopLogprobs};
}

}  // namespace pagedkv::runtime
