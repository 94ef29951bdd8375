// DevicePools (device.h): the pools in device memory, the pinned host tier, and the block copies.
#include <cstring>

#include "pagedkv/runtime/copy_plan.h"
#include "pagedkv/runtime/device.h"

namespace pagedkv::runtime {

CudaError::CudaError(std::string const& what, cudaError_t code)
    : std::runtime_error(what + ": " + cudaGetErrorName(code) + ": " + cudaGetErrorString(code)), code(code) {}
CudaError::~CudaError() = default;

void checkCuda(cudaError_t err, char const* what) {
    if (err != cudaSuccess) throw CudaError(what, err);
}

DevicePools::DevicePools(std::vector<PoolGroup> groups, std::vector<int64_t> const& numBlocks,
                         std::vector<int64_t> const& hostBlocks, bool poison, cudaStream_t stream)
    : groups_(std::move(groups)), numBlocks_(numBlocks), hostBlocks_(hostBlocks) {
    size_t const G = groups_.size();
    hostBlocks_.resize(G, 0);
    device_.assign(G, nullptr);
    host_.assign(G, nullptr);
    try {
        for (size_t g = 0; g < G; ++g) {
            int64_t const bytes = numBlocks_[g] * groups_[g].blockBytes();
            if (bytes > 0) {
                checkCuda(cudaMalloc(&device_[g], size_t(bytes)), "cudaMalloc (KV pool)");
                checkCuda(cudaMemsetAsync(device_[g], poison ? 0xFF : 0, size_t(bytes), stream), "poison the KV pool");
            }
            int64_t const hostBytes = hostBlocks_[g] * groups_[g].blockBytes();
            if (hostBytes > 0) {
                checkCuda(cudaHostAlloc(&host_[g], size_t(hostBytes), cudaHostAllocDefault), "cudaHostAlloc (host tier)");
                std::memset(host_[g], poison ? 0xFF : 0, size_t(hostBytes));
            }
        }
    } catch (...) {
        release();
        throw;
    }
}

DevicePools::~DevicePools() { release(); }

void DevicePools::release() {
    for (void*& p : device_) {
        if (p) cudaFree(p);
        p = nullptr;
    }
    for (void*& p : host_) {
        if (p) cudaFreeHost(p);
        p = nullptr;
    }
}

uint64_t DevicePools::address(int32_t group, Tier tier) const {
    return reinterpret_cast<uint64_t>(tier == Tier::kPrimary ? device_.at(group) : host_.at(group));
}

void DevicePools::run(std::vector<BlockCopy> const& copies, cudaStream_t stream) const {
    for (BlockCopy const& c : copies) {
        PoolGroup const& spec = groups_.at(c.group);
        int64_t const bytes = spec.blockBytes();
        auto at = [&](Tier tier, int32_t block) {
            int64_t const count = tier == Tier::kPrimary ? numBlocks_[c.group] : hostBlocks_[c.group];
            if (block < 0 || block >= count)  // the manager hands out only valid ids: a bug, not input
                throw std::logic_error("block copy: block " + std::to_string(block) + " outside the " +
                                       tierName(tier) + " tier of group " + quoted(spec.name));
            return reinterpret_cast<char*>(address(c.group, tier)) + block * bytes;
        };
        char* dst = at(c.dstTier, c.dstBlock);
        char const* src = at(c.srcTier, c.srcBlock);
        CopyPlan const plan = copyPlan(spec.layout, spec.itemsize(), c.numTokens);
        if (plan.contiguous())
            checkCuda(cudaMemcpyAsync(dst, src, size_t(plan.rows == 1 ? plan.width : plan.rows * plan.pitch),
                                      cudaMemcpyDefault, stream),
                      "block copy (cudaMemcpyAsync)");
        else
            checkCuda(cudaMemcpy2DAsync(dst, size_t(plan.pitch), src, size_t(plan.pitch), size_t(plan.width),
                                        size_t(plan.rows), cudaMemcpyDefault, stream),
                      "partial block copy (cudaMemcpy2DAsync)");
    }
}

}  // namespace pagedkv::runtime
