// The device side of the C++ runtime (CUDA runtime API; the KV manager core stays host-only): the pools, the
// copies, one pinned staging buffer uploaded with one copy per step, CUDA graphs of decode steps, and
// DeviceExecutor, what the TensorRT executor (trt_engine.h) and the test host's plugins-only executor share.
//
// One stream per executor; everything of a step is enqueued on it in order — the KV manager's block copies
// (copy-on-write, swap out / in), the input upload, the model, the output download — and the only host sync of
// a step is the one that reads the sampled tokens (and the kv_write_status records) back.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "pagedkv/runtime/executor.h"

namespace pagedkv::runtime {

// A CUDA runtime call failed: "what: cudaErrorName: description".
class CudaError : public std::runtime_error {
public:
    CudaError(std::string const& what, cudaError_t code);
    ~CudaError() override;
    cudaError_t code;
};
void checkCuda(cudaError_t err, char const* what);

// The pools of a KV manager's groups: one device allocation per group ([NB, L, 2, KVH, P, D] or NHD, the layout
// contract's pool), poisoned with 0xFF bytes (NaN for fp16/bf16/fp8, -1 for int8) so that unwritten slots are
// recognisable, and the pinned host tier (cudaHostAlloc). run() executes block copies with the geometry of
// copy_plan.h: cudaMemcpyAsync for a whole block, cudaMemcpy2DAsync for the first N tokens.
class DevicePools {
public:
    DevicePools(std::vector<PoolGroup> groups, std::vector<int64_t> const& numBlocks,
                std::vector<int64_t> const& hostBlocks, bool poison, cudaStream_t stream);
    ~DevicePools();
    DevicePools(DevicePools const&) = delete;
    DevicePools& operator=(DevicePools const&) = delete;

    uint64_t address(int32_t group, Tier tier = Tier::kPrimary) const;
    void run(std::vector<BlockCopy> const& copies, cudaStream_t stream) const;  // in order, asynchronous

private:
    void release();
    std::vector<PoolGroup> groups_;
    std::vector<void*> device_, host_;
    std::vector<int64_t> numBlocks_, hostBlocks_;
};

// A step's named arrays packed back to back (256-byte aligned, in the order they were declared) into one
// pinned staging buffer and its device twin, sized for the largest step: offsets follow the step's shape, so a
// step is one cudaMemcpyAsync of what it uses, and a shape always gets the same addresses (CUDA graphs).
class StagedArrays {
public:
    static constexpr int64_t kAlign = 256;
    int32_t declare(std::string name, int64_t maxBytes);  // returns the array's slot
    void allocate();
    ~StagedArrays();

    // Lay the arrays out for one step (bytes per slot, 0: absent); returns the bytes used.
    int64_t pack(std::vector<int64_t> const& bytes);
    void* host(int32_t slot) const { return static_cast<char*>(pinned_) + offsets_[slot]; }
    void* device(int32_t slot) const { return static_cast<char*>(device_) + offsets_[slot]; }
    int64_t used() const { return used_; }
    std::string const& name(int32_t slot) const { return names_[slot]; }
    int32_t slots() const { return int32_t(names_.size()); }
    void upload(cudaStream_t stream) const;    // host -> device, the packed bytes
    void download(cudaStream_t stream) const;  // device -> host

private:
    std::vector<std::string> names_;
    std::vector<int64_t> max_, offsets_;
    int64_t capacity_ = 0, used_ = 0;
    void* pinned_ = nullptr;
    void* device_ = nullptr;
};

// Captured CUDA graphs by key (a decode bucket's shape), the least recently used released beyond `capacity`.
class GraphCache {
public:
    using Key = std::tuple<int32_t, int32_t, int32_t>;  // (sequences, block-table columns, penalty width)
    explicit GraphCache(int32_t capacity) : capacity_(capacity) {}
    ~GraphCache() { clear(); }
    bool launch(Key const& key, cudaStream_t stream);  // false when there is none for the key
    // Capture what `enqueue` puts on `stream` (cudaStreamBeginCapture ... EndCapture) under `key`.
    template <typename F>
    void capture(Key const& key, cudaStream_t stream, F&& enqueue) {
        checkCuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
        try {
            enqueue();
        } catch (...) {
            cudaGraph_t broken = nullptr;
            cudaStreamEndCapture(stream, &broken);
            if (broken) cudaGraphDestroy(broken);
            throw;
        }
        cudaGraph_t graph = nullptr;
        checkCuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
        keep(key, graph);
    }
    void clear();
    int32_t size() const { return int32_t(graphs_.size()); }

private:
    void keep(Key const& key, cudaGraph_t graph);
    int32_t capacity_;
    std::list<Key> order_;  // most recently used last
    std::map<Key, std::pair<cudaGraph_t, cudaGraphExec_t>> graphs_;
};

struct DeviceOptions {
    std::vector<int64_t> numBlocks;  // blocks per pool group; empty: kvMemoryFraction of the free device memory
    double kvMemoryFraction = 0.5;
    std::vector<double> shares;       // the budget's split between groups (empty: the same block count)
    std::vector<int64_t> hostBlocks;  // pinned host tier per group (empty: none)
    bool prefixReuse = true;
    bool cudaGraphs = true;  // capture decode steps (padded to buckets) and replay them
    int32_t maxGraphs = 32;
    bool poison = true;
};

// What every device executor shares (the twin of the Python TrtExecutor's arenas and graphs):
//  * the KV manager and its DevicePools, the `kv_pools` rows uploaded once;
//  * the engine inputs in one StagedArrays (layout() hands out the pinned slices; execute() uploads them in one
//    copy), the sampling outputs and the kv_write_status records in another (one download);
//  * decode steps with CUDA graphs: padded to a bucket — sequences and block-table columns rounded up to powers
//    of two within the limits — whose padding rows write distinct slots of blocks held by the executor's own
//    padding sequence (kPadSequence, reserved at construction) and are ignored; the first step of a bucket runs
//    eagerly, is captured, and later steps of that bucket upload their inputs and launch the graph.
// A subclass enqueues the model (enqueue) and may read its own outputs (results).
class DeviceExecutor : public Executor {
public:
    static constexpr SeqId kPadSequence = std::numeric_limits<SeqId>::min();  // the sequence padding rows write into

    ~DeviceExecutor() override;
    KVManager& kv() override { return kv_; }
    ModelInfo const& model() const override { return model_; }
    StepLimits const& limits() const override { return limits_; }
    int64_t heldBlocks(int32_t group) const override;  // the padding sequence's
    StepInputBuffers const& layout(StepShape& shape) override;
    StepOutputs execute(StepShape const& shape) override;

    cudaStream_t stream() const { return stream_; }
    DevicePools const& pools() const { return *pools_; }
    int32_t numGraphs() const { return graphs_.size(); }
    std::string const& graphsOffReason() const { return graphsOff_; }  // empty while CUDA graphs are on

protected:
    // `limits` must bound every dimension (> 0), with one maxBlocks entry per group.
    DeviceExecutor(std::vector<PoolGroup> groups, ModelInfo model, StepLimits limits, DeviceOptions const& options);
    // Enqueue the model on stream() for `run` (padded when a decode bucket), its inputs uploaded at
    // inputDevice(); no host sync. Called again inside a CUDA-graph capture.
    virtual void enqueue(StepShape const& run) = 0;
    // Called before every launch (eager or a graph replay), e.g. to set the engine's input shapes.
    virtual void setShapes(StepShape const& run) { (void)run; }
    // The sampled rows after the step's sync (default: the next_tokens ... outputs the model wrote).
    virtual StepOutputs results(StepShape const& run);

    // Device addresses of the step's arrays (valid for the shape last laid out).
    void* inputDevice(int32_t slot) const { return in_.device(slot); }
    void* outputDevice(int32_t slot) const { return out_.device(slot); }
    void const* outputHost(int32_t slot) const { return out_.host(slot); }
    StagedArrays const& inputs() const { return in_; }
    StagedArrays const& outputs() const { return out_; }
    uint64_t kvPoolsDevice() const { return reinterpret_cast<uint64_t>(kvPools_); }
    StepInputBuffers const& hostInputs() const { return buffers_; }

    // Slots (StagedArrays) of the engine_io tensors; -1 when the engine has none.
    struct InputSlots {
        int32_t inputIds = -1, cuQLens = -1, pastLens = -1, positionIds = -1, logitsRows = -1, samplingParams = -1,
                penaltyTokens = -1, penaltyCounts = -1;
        std::vector<int32_t> blockTables;
    } inSlot;
    struct OutputSlots {
        int32_t nextTokens = -1, nextLogprobs = -1, topTokens = -1, topLogprobs = -1;
        std::vector<int32_t> statuses;  // kv_write_status_{i}
    } outSlot;

private:
    int32_t decodeColumns(StepShape const& shape) const;
    void packFor(StepShape const& shape);
    void padDecode(StepShape const& real, StepShape& run);

    ModelInfo model_;
    StepLimits limits_;
    cudaStream_t stream_ = nullptr;
    std::unique_ptr<DevicePools> pools_;
    KVManager kv_;
    StagedArrays in_, out_;
    void* kvPools_ = nullptr;
    StepInputBuffers buffers_;
    GraphCache graphs_;
    bool graphsOn_ = false;
    std::string graphsOff_;
    std::vector<std::vector<int32_t>> padRows_;  // [G] the padding sequence's block list
    StepShape laidOut_;
};

}  // namespace pagedkv::runtime
