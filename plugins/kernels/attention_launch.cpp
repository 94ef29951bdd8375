// launchAttention: validate (before any CUDA call), plan (attention_plan.cpp: the one scheduling decision),
// fold the scales, launch the decode / multi-token kernels and the split-K merge on `stream`. Never syncs.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "attention_kernels.h"
#include "attention_plan.h"
#include "launch_common.h"
#include "pagedkv/attention.h"

namespace pagedkv {
namespace attn {
namespace {

constexpr float kLog2eHost = 1.4426950408889634f;

AttentionKernelParams makeKernelParams(AttentionParams const& p, AttentionPlan const& plan) {
    AttentionKernelParams k{};
    k.params = p;
    k.groupSize = plan.groupSize;
    k.cacheIsFp8 = p.cacheDType == CacheDType::kFP8E4M3 ? 1 : 0;
    // The kernels multiply stored values as they are; every scale is folded here:
    // logit = (q_stored . k_stored) * qScale * kScale * softmaxScale, out = (P . v_stored) * vScale.
    bool const quantized = p.cacheDType == CacheDType::kFP8E4M3 || p.cacheDType == CacheDType::kINT8;
    double softmaxScale = p.softmaxScale > 0.f ? double(p.softmaxScale) : 1.0 / std::sqrt(double(p.headDim));
    double rawScale = softmaxScale * (quantized ? double(p.kScale) : 1.0) * (p.qFP8 ? double(p.qScale) : 1.0);
    k.useSoftcap = p.logitSoftcap > 0.f ? 1 : 0;
    // > 0 even when the product underflows float: softmaxStep multiplies -inf (masked) scores by it, and a
    // scale this small makes every logit 0 either way.
    k.scoreScaleLog2 = std::max(float(rawScale * double(kLog2eHost)), std::numeric_limits<float>::min());
    k.capInScale = k.useSoftcap ? float(rawScale / double(p.logitSoftcap)) : 0.f;
    k.capOutScaleLog2 = k.useSoftcap ? float(double(p.logitSoftcap) * double(kLog2eHost)) : 0.f;
    k.outScale = quantized ? p.vScale : 1.f;
    k.split = plan.split;
    if (plan.partialChunks > 0) {
        k.partialOut = static_cast<float*>(p.workspace);
        k.partialLse = reinterpret_cast<float*>(
            static_cast<unsigned char*>(p.workspace) +
            partialOutBytes(plan.partialChunks, p.meta.numTokens, p.numQHeads, p.headDim));
    }
    if (plan.kvRowMapOffset >= 0) k.kvRowMaps = static_cast<unsigned char*>(p.workspace) + plan.kvRowMapOffset;
    return k;
}

// PAGEDKV_DECODE_WARPS, read at every launch (A/B benchmarks; the tests that run each width on one GPU): unset or
// empty, the plan picks the decode CTA width; "2", "4" or "8" leaves it only that width, which must be compiled for
// the instance and fit the device.
cudaError_t restrictDecodeWidth(AttentionParams const& p, int32_t (&ctasPerSm)[kNumDecodeWidths]) {
    char const* const value = std::getenv("PAGEDKV_DECODE_WARPS");
    std::string const v = value != nullptr ? value : "";
    if (v.empty()) return cudaSuccess;
    std::vector<int32_t> offered;  // the widths compiled for the instance that fit the device
    int32_t keep = -1;
    for (int32_t i = 0; i < kNumDecodeWidths; ++i) {
        if (ctasPerSm[i] > 0) offered.push_back(kDecodeWidthWarps[i]);
        if (v == std::to_string(kDecodeWidthWarps[i]) && ctasPerSm[i] > 0) keep = i;
    }
    if (keep < 0)
        return invalidArgument("PAGEDKV_DECODE_WARPS=" + v +
                               ": expected one of the decode widths compiled for io_dtype=" +
                               std::to_string(static_cast<int32_t>(p.ioDType)) + " cache_dtype=" +
                               std::to_string(static_cast<int32_t>(p.cacheDType)) + " head_dim=" +
                               std::to_string(p.headDim) + " that fit this GPU: " + commaList(offered));
    for (int32_t i = 0; i < kNumDecodeWidths; ++i)
        if (i != keep) ctasPerSm[i] = 0;
    return cudaSuccess;
}

// PAGEDKV_DECODE_CHUNKS, read at every launch (A/B benchmarks of the decode split; the tests that run forced
// splits): unset or empty, the split model picks the chunk count; a whole number in [1, kMaxGridChunks] asks for that
// many chunks (PlanSettings::decodeChunks: capped by what the plan can split into).
cudaError_t decodeChunksSetting(PlanSettings& settings) {
    char const* const value = std::getenv("PAGEDKV_DECODE_CHUNKS");
    std::string const v = value != nullptr ? value : "";
    if (v.empty()) return cudaSuccess;
    bool const digits = v.size() <= 4 && v.find_first_not_of("0123456789") == std::string::npos;
    int32_t const n = digits ? std::stoi(v) : 0;
    if (n < 1 || n > kMaxGridChunks)
        return invalidArgument("PAGEDKV_DECODE_CHUNKS=" + v + ": expected a whole number in [1, " +
                               std::to_string(kMaxGridChunks) + "] (or unset: the plan's split)");
    settings.decodeChunks = n;
    return cudaSuccess;
}

}  // namespace

cudaError_t planOnCurrentDevice(AttentionParams const& params, AttentionPlan& plan) {
    // Which kernels run does not depend on the device; how much to split (and the decode width) does. Plan once
    // to know which kernels' occupancy to ask for, then plan with the facts.
    DeviceFacts facts{smCountOfCurrentDevice(), {0, 0, 0}, 1};
    plan = planAttention(params, facts);
    PlanSettings settings{};
    cudaError_t err = cudaSuccess;
    if (plan.runDecode) {
        err = decodeKernelOccupancies(params.ioDType, params.cacheDType, params.headDim, facts.decodeCtasPerSm);
        if (err == cudaSuccess) err = restrictDecodeWidth(params, facts.decodeCtasPerSm);
        if (err == cudaSuccess) err = decodeChunksSetting(settings);
        if (err != cudaSuccess) return err;
    }
    if (plan.runMulti) {
        err = multiKernelOccupancy(params.ioDType, params.cacheDType, params.headDim, facts.multiCtasPerSm,
                                   facts.multiTileRows);
        if (err != cudaSuccess) return err;
    }
    plan = planAttention(params, facts, settings);
    return cudaSuccess;
}

namespace {

cudaError_t launchAll(AttentionParams const& params, cudaStream_t stream) {
    AttentionPlan plan{};
    cudaError_t err = planOnCurrentDevice(params, plan);
    if (err != cudaSuccess) return err;
    AttentionKernelParams const kp = makeKernelParams(params, plan);

    if (plan.runDecode) {
        err = launchDecodeKernel(kp, params.ioDType, params.cacheDType, params.headDim, plan.decodeWarps,
                                 plan.decodeGrid, stream);
        if (err != cudaSuccess) return err;
    }
    if (plan.runMulti) {
        err = launchMultiKernel(kp, params.ioDType, params.cacheDType, params.headDim, plan.multiGrid, stream);
        if (err != cudaSuccess) return err;
    }
    if (plan.runMerge) {
        err = launchMergeKernel(kp, params.ioDType, params.headDim, plan.mergeGrid, stream);
        if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
}

}  // namespace
}  // namespace attn

cudaError_t launchAttention(AttentionParams const& params, cudaStream_t stream) {
    clearLastError();  // only this launch's failures may be reported
    cudaError_t err = attn::validateAttentionParams(params);
    if (err != cudaSuccess || params.meta.numTokens == 0) return err;
    return recordCudaError(attn::launchAll(params, stream), "launchAttention");
}

}  // namespace pagedkv
