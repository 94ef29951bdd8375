// StagedArrays and GraphCache (device.h).
#include <stdexcept>

#include "pagedkv/runtime/device.h"

namespace pagedkv::runtime {

namespace {
int64_t aligned(int64_t bytes) { return (bytes + StagedArrays::kAlign - 1) / StagedArrays::kAlign * StagedArrays::kAlign; }
}  // namespace

int32_t StagedArrays::declare(std::string name, int64_t maxBytes) {
    if (pinned_) throw std::logic_error("StagedArrays: declare after allocate");
    names_.push_back(std::move(name));
    max_.push_back(maxBytes);
    offsets_.push_back(0);
    capacity_ += aligned(maxBytes);
    return int32_t(names_.size() - 1);
}

void StagedArrays::allocate() {
    int64_t const bytes = capacity_ > 0 ? capacity_ : kAlign;
    checkCuda(cudaHostAlloc(&pinned_, size_t(bytes), cudaHostAllocDefault), "cudaHostAlloc (staging)");
    checkCuda(cudaMalloc(&device_, size_t(bytes)), "cudaMalloc (step arrays)");
}

StagedArrays::~StagedArrays() {
    if (pinned_) cudaFreeHost(pinned_);
    if (device_) cudaFree(device_);
}

int64_t StagedArrays::pack(std::vector<int64_t> const& bytes) {
    int64_t at = 0;
    used_ = 0;
    for (size_t i = 0; i < names_.size(); ++i) {
        if (bytes[i] > max_[i])
            throw std::length_error(names_[i] + ": " + std::to_string(bytes[i]) + " bytes exceed the " +
                                    std::to_string(max_[i]) + " the engine's limits allow");
        offsets_[i] = at;
        if (bytes[i] > 0) used_ = at + bytes[i];
        at += aligned(bytes[i]);
    }
    return used_;
}

void StagedArrays::upload(cudaStream_t stream) const {
    if (used_) checkCuda(cudaMemcpyAsync(device_, pinned_, size_t(used_), cudaMemcpyHostToDevice, stream), "upload the step");
}

void StagedArrays::download(cudaStream_t stream) const {
    if (used_)
        checkCuda(cudaMemcpyAsync(pinned_, device_, size_t(used_), cudaMemcpyDeviceToHost, stream), "download the step");
}

bool GraphCache::launch(Key const& key, cudaStream_t stream) {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) return false;
    order_.remove(key);
    order_.push_back(key);
    checkCuda(cudaGraphLaunch(it->second.second, stream), "cudaGraphLaunch");
    return true;
}

void GraphCache::keep(Key const& key, cudaGraph_t graph) {
    cudaGraphExec_t exec = nullptr;
    cudaError_t const err = cudaGraphInstantiate(&exec, graph, 0);
    if (err != cudaSuccess) {
        cudaGraphDestroy(graph);
        throw CudaError("cudaGraphInstantiate", err);
    }
    graphs_[key] = {graph, exec};
    order_.push_back(key);
    while (int32_t(graphs_.size()) > capacity_) {
        auto oldest = graphs_.find(order_.front());
        cudaGraphExecDestroy(oldest->second.second);
        cudaGraphDestroy(oldest->second.first);
        graphs_.erase(oldest);
        order_.pop_front();
    }
}

void GraphCache::clear() {
    for (auto& [key, pair] : graphs_) {
        cudaGraphExecDestroy(pair.second);
        cudaGraphDestroy(pair.first);
    }
    graphs_.clear();
    order_.clear();
}

}  // namespace pagedkv::runtime
