// launchQKVWrite: host-side validation, work plan and the single dtype dispatch point of the fused
// QKV-preprocess + paged KV write (kernel: qkv_write_kernel.cuh; instances: qkv_write_fp16.cu, _bf16.cu).
//
// Everything here up to the dispatch runs without touching CUDA, so invalid parameters are reported (with
// the field and the value) even on a machine without a GPU. Nothing here synchronizes.
#include <cmath>
#include <cstdint>
#include <string>

#include "launch_common.h"
#include "pagedkv/qkv_write.h"
#include "qkv_write_params.cuh"

namespace pagedkv {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

bool finitePositive(float v) { return std::isfinite(v) && v > 0.f; }

uintptr_t address(void const* p) { return reinterpret_cast<uintptr_t>(p); }

bool aligned(void const* p, uintptr_t bytes) { return address(p) % bytes == 0; }

cudaError_t validateRope(QKVWriteParams const& p) {
    RopeParams const& r = p.rope;
    PKV_REQUIRE(r.style == RopeStyle::kNone || r.style == RopeStyle::kNeox || r.style == RopeStyle::kGptj,
                "rope_style", static_cast<int32_t>(r.style), "0 (none), 1 (neox) or 2 (gptj)");
    if (r.style == RopeStyle::kNone) return cudaSuccess;
    PKV_REQUIRE(r.rotaryDim >= 2 && r.rotaryDim <= p.headDim && r.rotaryDim % 2 == 0, "rope_rotary_dim",
                r.rotaryDim, "even and in [2, head_dim=" + str(p.headDim) + "]");
    PKV_REQUIRE(std::isfinite(r.mscale), "rope.mscale", r.mscale, "finite");
    for (int32_t i = 0; i < r.rotaryDim / 2; ++i)
        PKV_REQUIRE(finitePositive(r.invFreq[i]), "rope.inv_freq[" + str(i) + "]", r.invFreq[i], "finite and > 0");
    PKV_REQUIRE(r.longAboveKVLen >= 0, "rope.long_above_kv_len", r.longAboveKVLen, ">= 0 (0: one table)");
    if (r.longAboveKVLen > 0) {
        for (int32_t i = 0; i < r.rotaryDim / 2; ++i)
            PKV_REQUIRE(finitePositive(r.longInvFreq[i]), "rope.long_inv_freq[" + str(i) + "]", r.longInvFreq[i],
                        "finite and > 0 with long_above_kv_len > 0");
    }
    return cudaSuccess;
}

cudaError_t validatePointers(QKVWriteParams const& p) {
    StepMetadata const& m = p.meta;
    int32_t const qAlign = p.qOutFP8 ? 8 : 16;  // one vector store of 8 elements
    PKV_REQUIRE(p.qkv != nullptr && aligned(p.qkv, 16), "qkv", address(p.qkv),
                "a non-null device pointer aligned to 16 bytes");
    PKV_REQUIRE(aligned(p.bias, 16), "bias", address(p.bias), "null or a device pointer aligned to 16 bytes");
    PKV_REQUIRE(p.qOut != nullptr && aligned(p.qOut, qAlign), "q_out", address(p.qOut),
                "a non-null device pointer aligned to " + str(qAlign) + " bytes");
    PKV_REQUIRE(p.status != nullptr && aligned(p.status, 4), "status", address(p.status),
                "a non-null device pointer to int32[4]");
    PKV_REQUIRE(aligned(p.positionIds, 4), "position_ids", address(p.positionIds),
                "null or a device pointer to int32[num_tokens]");
    PKV_REQUIRE(m.poolDescs != nullptr && aligned(m.poolDescs, 8), "pool_descs", address(m.poolDescs),
                "a non-null device pointer to int64[num_pools, 4]");
    PKV_REQUIRE(m.cuQLens != nullptr && aligned(m.cuQLens, 4), "cu_q_lens", address(m.cuQLens),
                "a non-null device pointer to int32[num_seqs + 1]");
    PKV_REQUIRE(m.pastLens != nullptr && aligned(m.pastLens, 4), "past_lens", address(m.pastLens),
                "a non-null device pointer to int32[num_seqs]");
    PKV_REQUIRE((m.blockTable != nullptr || m.maxBlocks == 0) && aligned(m.blockTable, 4), "block_table",
                address(m.blockTable), "a non-null device pointer to int32[num_seqs, max_blocks]");
    return cudaSuccess;
}

}  // namespace

cudaError_t validateQKVWrite(QKVWriteParams const& p) {
    StepMetadata const& m = p.meta;
    PKV_REQUIRE(m.numTokens >= 0, "num_tokens", m.numTokens, ">= 0");
    PKV_REQUIRE(m.numSeqs >= 0, "num_seqs", m.numSeqs, ">= 0");
    PKV_REQUIRE(m.numTokens == 0 || m.numSeqs > 0, "num_seqs", m.numSeqs,
                "> 0 when num_tokens=" + str(m.numTokens) + " > 0");
    PKV_REQUIRE(m.maxBlocks >= 0, "max_blocks", m.maxBlocks, ">= 0");
    PKV_REQUIRE(m.poolIndex >= 0, "pool_index", m.poolIndex, ">= 0");
    PKV_REQUIRE(isSupportedHeadDim(p.headDim), "head_dim", p.headDim,
                std::string("one of ") + supportedHeadDimsText());
    PKV_REQUIRE(isSupportedIODType(p.ioDType), "io_dtype", static_cast<int32_t>(p.ioDType), supportedIODTypesText());
    PKV_REQUIRE(isSupportedCacheDType(p.cacheDType), "cache_dtype", static_cast<int32_t>(p.cacheDType),
                supportedCacheDTypesText());
    PKV_REQUIRE(p.numQHeads > 0, "num_q_heads", p.numQHeads, "> 0");
    PKV_REQUIRE(p.numKVHeads > 0, "num_kv_heads", p.numKVHeads, "> 0");
    PKV_REQUIRE(p.numQHeads % p.numKVHeads == 0, "num_q_heads", p.numQHeads,
                "a multiple of num_kv_heads=" + str(p.numKVHeads));
    PKV_REQUIRE(finitePositive(p.kScale), "k_scale", p.kScale, "finite and > 0");
    PKV_REQUIRE(finitePositive(p.vScale), "v_scale", p.vScale, "finite and > 0");
    PKV_REQUIRE(!p.qOutFP8 || finitePositive(p.qScale), "q_scale", p.qScale, "finite and > 0 with q_out_fp8");
    // The kernel numbers its (token, pass) pairs with int32: P = ceil(NHR / floor(32/VPH)) passes per token, and
    // half the int32 range leaves room for the prefetch running ahead.
    int64_t const passesPerToken = ceilDiv(p.numQHeads + 2 * p.numKVHeads, 32 / (p.headDim / 8));
    int64_t const maxPasses = INT32_MAX / 2;
    PKV_REQUIRE(static_cast<int64_t>(m.numTokens) * passesPerToken <= maxPasses, "num_tokens", m.numTokens,
                "at most " + str(maxPasses / passesPerToken) + " for these head counts");
    if (FieldIssue const bad = checkKVLayoutFor(p.layout, p.numKVHeads, p.headDim, p.layer)) return invalidField(bad);
    cudaError_t err = validateRope(p);
    if (err == cudaSuccess && m.numTokens > 0) err = validatePointers(p);
    return err;
}

// The plan cuts a head row into VPH = D/8 vectors of 8 elements and a warp pass into floor(32/VPH) rows: every
// supported head dim must give 1 <= VPH <= 32 (a row fits a warp) and the multiply that stands for lane / VPH
// must be exact for every lane (a new head dim that does not fit needs a new plan).
constexpr bool writePlanCovers(int32_t headDim) {
    int32_t const vecsPerRow = headDim / 8;
    if (headDim % 8 != 0 || vecsPerRow < 1 || vecsPerRow > 32) return false;
    for (int32_t lane = 0; lane < 32; ++lane)
        if (laneRowOf(lane, laneRowMagic(vecsPerRow)) != lane / vecsPerRow) return false;
    return true;
}
static_assert([] {
    for (int32_t d : kSupportedHeadDims)
        if (!writePlanCovers(d)) return false;
    return true;
}(), "a head dim of kSupportedHeadDims (capabilities.h) does not fit the write kernel's plan");

QKVWritePlan makeQKVWritePlan(QKVWriteParams const& p) {
    QKVWritePlan plan{};
    plan.vecsPerRow = p.headDim / 8;
    plan.laneRowMagic = laneRowMagic(plan.vecsPerRow);
    plan.rowsPerPass = 32 / plan.vecsPerRow;
    plan.numHeadRows = p.numQHeads + 2 * p.numKVHeads;
    plan.passesPerToken = ceilDiv(plan.numHeadRows, plan.rowsPerPass);
    plan.totalPasses = static_cast<int64_t>(p.meta.numTokens) * plan.passesPerToken;
    plan.numWarps = 0;  // set at launch
    return plan;
}

QKVWriteKernelParams makeQKVWriteKernelParams(QKVWriteParams const& p) {
    QKVWriteKernelParams kp{};
    kp.p = p;
    kp.plan = makeQKVWritePlan(p);
    int32_t const rotary = p.rope.style == RopeStyle::kNone ? 0 : p.rope.rotaryDim;
    kp.ropeHalf = rotary / 2;
    if (rotary == 0) {
        kp.ropePartner = RopePartner::kNone;
    } else if (p.rope.style == RopeStyle::kGptj) {
        kp.ropePartner = RopePartner::kInVector;
    } else {
        kp.ropePartner = kp.ropeHalf % 8 == 0 ? RopePartner::kShuffle : RopePartner::kGlobal;
    }
    kp.ropeLongAboveKVLen = kp.ropeHalf > 0 ? p.rope.longAboveKVLen : 0;
    for (int32_t i = 0; i < kp.ropeHalf; ++i) {
        kp.ropeTurns[i] = ropeTurnsPerPosition(p.rope.invFreq[i]);
        kp.ropeTurnsLong[i] = kp.ropeLongAboveKVLen > 0 ? ropeTurnsPerPosition(p.rope.longInvFreq[i]) : 0;
    }
    kp.seqsPerToken = p.meta.numTokens > 0 ? static_cast<float>(p.meta.numSeqs) / p.meta.numTokens : 0.f;
    kp.invKScale = 1.f / p.kScale;
    kp.invVScale = 1.f / p.vScale;
    kp.invQScale = p.qOutFP8 ? 1.f / p.qScale : 1.f;
    return kp;
}

namespace {

template <IODType IO>
cudaError_t dispatchCache(QKVWriteKernelParams const& kp, int32_t smCount, cudaStream_t stream) {
    switch (kp.p.cacheDType) {
        case CacheDType::kFP16: return runQKVWriteKernel<IO, CacheDType::kFP16>(kp, smCount, stream);
        case CacheDType::kBF16: return runQKVWriteKernel<IO, CacheDType::kBF16>(kp, smCount, stream);
        case CacheDType::kFP8E4M3: return runQKVWriteKernel<IO, CacheDType::kFP8E4M3>(kp, smCount, stream);
        case CacheDType::kINT8: return runQKVWriteKernel<IO, CacheDType::kINT8>(kp, smCount, stream);
        default: break;
    }
    return invalidArgument("cache_dtype=" + str(static_cast<int32_t>(kp.p.cacheDType)) +
                           ": no QKV-write kernel for this cache dtype");
}

cudaError_t dispatchIO(QKVWriteKernelParams const& kp, int32_t smCount, cudaStream_t stream) {
    switch (kp.p.ioDType) {
        case IODType::kFP16: return dispatchCache<IODType::kFP16>(kp, smCount, stream);
        case IODType::kBF16: return dispatchCache<IODType::kBF16>(kp, smCount, stream);
        default: break;
    }
    return invalidArgument("io_dtype=" + str(static_cast<int32_t>(kp.p.ioDType)) +
                           ": no QKV-write kernel for this I/O dtype");
}

}  // namespace

cudaError_t launchQKVWrite(QKVWriteParams const& params, cudaStream_t stream) {
    clearLastError();  // only this launch's failures may be reported
    cudaError_t err = validateQKVWrite(params);
    if (err != cudaSuccess || params.meta.numTokens == 0) return err;
    QKVWriteKernelParams const kp = makeQKVWriteKernelParams(params);
    // The one dispatch point: (I/O dtype) x (cache dtype) kernel instances; head dim and RoPE style are
    // runtime values validated above (kSupportedHeadDims; none/neox/gptj).
    return recordCudaError(dispatchIO(kp, smCountOfCurrentDevice(), stream), "launchQKVWrite");
}

}  // namespace pagedkv
