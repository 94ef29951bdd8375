// Kernel instances of the fused QKV write for fp16 activations, one per cache dtype (4 of the 8 instances;
// split by I/O dtype so that the two halves compile in parallel).
#include "qkv_write_kernel.cuh"

namespace pagedkv {

template cudaError_t runQKVWriteKernel<IODType::kFP16, CacheDType::kFP16>(QKVWriteKernelParams const&, int32_t,
                                                                          cudaStream_t);
template cudaError_t runQKVWriteKernel<IODType::kFP16, CacheDType::kBF16>(QKVWriteKernelParams const&, int32_t,
                                                                          cudaStream_t);
template cudaError_t runQKVWriteKernel<IODType::kFP16, CacheDType::kFP8E4M3>(QKVWriteKernelParams const&, int32_t,
                                                                             cudaStream_t);
template cudaError_t runQKVWriteKernel<IODType::kFP16, CacheDType::kINT8>(QKVWriteKernelParams const&, int32_t,
                                                                          cudaStream_t);

}  // namespace pagedkv
