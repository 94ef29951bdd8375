// The Hopper multi-token kernel's host side, shared by its translation units: attention_multi_sm90.cu (the dispatch
// over the capability table, the TMA loads' host side) and attention_multi_sm90_d<D>.cu, one per head dim (the
// kernels' instances, attention_multi_sm90.cuh).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "attention_kernels.h"

namespace pagedkv {
namespace attn {

// One instance (compute type CT, 8-bit cache or not, head dim kD; the warp-specialized or the cooperative kernel):
// its resident CTAs per SM into ctasPerSm, and with kp its launch on `stream` over the plan's grid of cells. Defined in
// attention_multi_sm90.cuh, instantiated in the head dim's translation unit (PKV_SM90_INSTANCES).
template <typename CT, bool k8Bit, int kD>
cudaError_t launchSm90Instance(bool warpSpecialized, int32_t& ctasPerSm, AttentionKernelParams const* kp, dim3 grid,
                               cudaStream_t stream);

// The TMA loads' host side (sm90/kv_row_map.cuh): whether a launch's workspace and pool let the warp-specialized kernel
// load by TMA, and the tensor map template it completes on the device.
bool kvRowMapsServe(AttentionKernelParams const& kp, int32_t headDim, uint32_t ctas);
cudaError_t kvRowMapTemplate(int32_t headDim, void* placeholder, CUtensorMap& map);

}  // namespace attn
}  // namespace pagedkv
