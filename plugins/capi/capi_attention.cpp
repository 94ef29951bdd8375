// C API of paged attention: the launcher, the workspace size, the plan and the host schedule replay, on the
// caller's AttentionParams. All validation is the launcher's (attention_plan.cpp), before any CUDA call.
#include "capi_attention.h"

#include <string>

#include "../kernels/attention_kernels.h"
#include "../kernels/attention_plan.h"
#include "../kernels/launch_common.h"

namespace {

using namespace pagedkv;

// Stand-in for device pointers the plan and the replay never dereference (validation wants them set).
void* const kNotDereferenced = reinterpret_cast<void*>(uintptr_t(256));

// For the plan (which never dereferences anything): stand-ins where validation wants a device pointer. The
// replay passes real host arrays for the metadata, so only missing pointers are replaced.
void fillStandIns(AttentionParams& p) {
    if (p.q == nullptr) p.q = kNotDereferenced;
    if (p.out == nullptr) p.out = kNotDereferenced;
    if (p.meta.poolDescs == nullptr) p.meta.poolDescs = static_cast<int64_t const*>(kNotDereferenced);
    if (p.meta.cuQLens == nullptr) p.meta.cuQLens = static_cast<int32_t const*>(kNotDereferenced);
    if (p.meta.pastLens == nullptr) p.meta.pastLens = static_cast<int32_t const*>(kNotDereferenced);
    if (p.meta.blockTable == nullptr) p.meta.blockTable = static_cast<int32_t const*>(kNotDereferenced);
    if (p.workspace == nullptr && p.workspaceBytes > 0) p.workspace = kNotDereferenced;
}

// The caller's params with stand-ins for the pointers nothing dereferences.
cudaError_t hostParams(AttentionParams const* params, AttentionParams& p) {
    if (params == nullptr) return invalidArgument("params=NULL: expected an AttentionParams");
    p = *params;
    fillStandIns(p);
    return cudaSuccess;
}

// The C API's record of a plan.
void fillPlanInfo(attn::AttentionPlan const& plan, PagedKVAttentionPlanInfo* out) {
    *out = PagedKVAttentionPlanInfo{};
    out->run_decode = plan.runDecode;
    out->run_multi = plan.runMulti;
    out->run_merge = plan.runMerge;
    out->decode_grid[0] = int32_t(plan.decodeGrid.x), out->decode_grid[1] = int32_t(plan.decodeGrid.y);
    out->decode_grid[2] = int32_t(plan.decodeGrid.z);
    out->multi_grid[0] = int32_t(plan.multiGrid.x), out->multi_grid[1] = int32_t(plan.multiGrid.y);
    out->multi_grid[2] = int32_t(plan.multiGrid.z);
    out->merge_grid = int32_t(plan.mergeGrid.x);
    out->decode_chunk_len = plan.split.decodeChunkLen;
    out->multi_chunk_len = plan.split.multiChunkLen;
    out->partial_chunks = plan.partialChunks;
    out->max_span = plan.maxSpan;
    out->workspace_bytes = int64_t(plan.workspaceBytes);
    out->decode_warps = plan.runDecode ? plan.decodeWarps : 0;
}

static_assert(PAGEDKV_DECODE_WIDTHS == attn::kNumDecodeWidths, "the C API's decode widths are the schedule's");

// The device facts and settings of a what-if plan: the caller's occupancies and forced decode split, checked.
cudaError_t hostFacts(int32_t smCount, int32_t const* decodeCtasPerSm, int32_t multiCtasPerSm, int32_t decodeChunks,
                      attn::DeviceFacts& facts, attn::PlanSettings& settings) {
    PKV_REQUIRE(smCount > 0, "sm_count", smCount, "> 0");
    if (decodeCtasPerSm == nullptr)
        return invalidArgument("decode_ctas_per_sm=NULL: expected " + std::to_string(attn::kNumDecodeWidths) +
                               " occupancies");
    bool any = false;
    for (int32_t i = 0; i < attn::kNumDecodeWidths; ++i) {
        PKV_REQUIRE(decodeCtasPerSm[i] >= 0, "decode_ctas_per_sm", decodeCtasPerSm[i],
                    ">= 0 (at " + std::to_string(attn::kDecodeWidthWarps[i]) + " warps)");
        facts.decodeCtasPerSm[i] = decodeCtasPerSm[i];
        any = any || decodeCtasPerSm[i] > 0;
    }
    PKV_REQUIRE(any, "decode_ctas_per_sm", 0, "> 0 at some width");
    PKV_REQUIRE(multiCtasPerSm > 0, "multi_ctas_per_sm", multiCtasPerSm, "> 0");
    facts.smCount = smCount;
    facts.multiCtasPerSm = multiCtasPerSm;
    PKV_REQUIRE(decodeChunks >= 0 && decodeChunks <= attn::kMaxGridChunks, "decode_chunks", decodeChunks,
                "in [0, " + std::to_string(attn::kMaxGridChunks) + "] (0: the plan's split)");
    settings.decodeChunks = decodeChunks;
    return cudaSuccess;
}

}  // namespace

extern "C" {

int32_t pagedkv_attention(const AttentionParams* params, cudaStream_t stream) {
    if (params == nullptr) {
        clearLastError();
        return invalidArgument("params=NULL: expected an AttentionParams");
    }
    return launchAttention(*params, stream);
}

int64_t pagedkv_attention_workspace_bytes(int32_t num_tokens, int32_t num_seqs, int32_t num_q_heads, int32_t head_dim,
                                          int32_t max_kv_len, int32_t page_size) {
    auto fail = [](std::string msg) -> int64_t {
        invalidArgument(std::move(msg));
        return -1;
    };
    clearLastError();
    if (num_tokens < 0) return fail("num_tokens=" + std::to_string(num_tokens) + ": expected >= 0");
    if (num_seqs < 0) return fail("num_seqs=" + std::to_string(num_seqs) + ": expected >= 0");
    if (num_q_heads <= 0) return fail("num_q_heads=" + std::to_string(num_q_heads) + ": expected > 0");
    if (!isSupportedHeadDim(head_dim))
        return fail("head_dim=" + std::to_string(head_dim) + ": expected one of " + supportedHeadDimsText());
    if (max_kv_len < 0) return fail("max_kv_len=" + std::to_string(max_kv_len) + ": expected >= 0");
    if (page_size <= 0) return fail("page_size=" + std::to_string(page_size) + ": expected > 0");
    return int64_t(attentionWorkspaceBytes(num_tokens, num_seqs, num_q_heads, head_dim, max_kv_len, page_size));
}

int32_t pagedkv_attention_plan(const AttentionParams* params, int32_t sm_count, const int32_t* decode_ctas_per_sm,
                               int32_t multi_ctas_per_sm, int32_t decode_chunks, PagedKVAttentionPlanInfo* out) {
    clearLastError();
    if (out == nullptr) return invalidArgument("out=NULL: expected a PagedKVAttentionPlanInfo");
    attn::DeviceFacts facts{};
    attn::PlanSettings settings{};
    cudaError_t err = hostFacts(sm_count, decode_ctas_per_sm, multi_ctas_per_sm, decode_chunks, facts, settings);
    AttentionParams p;
    if (err == cudaSuccess) err = hostParams(params, p);
    if (err == cudaSuccess) err = attn::validateAttentionParams(p);
    if (err != cudaSuccess) return err;
    fillPlanInfo(attn::planAttention(p, facts, settings), out);
    return 0;
}

int32_t pagedkv_attention_device_plan(const AttentionParams* params, PagedKVAttentionPlanInfo* out) {
    clearLastError();
    if (out == nullptr) return invalidArgument("out=NULL: expected a PagedKVAttentionPlanInfo");
    AttentionParams p;
    cudaError_t err = hostParams(params, p);
    if (err == cudaSuccess) err = attn::validateAttentionParams(p);
    attn::AttentionPlan plan{};
    if (err == cudaSuccess && p.meta.numTokens > 0) err = attn::planOnCurrentDevice(p, plan);
    if (err != cudaSuccess) return recordCudaError(err, "pagedkv_attention_device_plan");
    fillPlanInfo(plan, out);
    return 0;
}

int32_t pagedkv_attention_kernel_shapes(int32_t io_dtype, int32_t cache_dtype, int32_t head_dim,
                                        PagedKVAttentionKernelShapes* out) {
    clearLastError();
    if (out == nullptr) return invalidArgument("out=NULL: expected a PagedKVAttentionKernelShapes");
    IODType const io = static_cast<IODType>(io_dtype);
    CacheDType const cache = static_cast<CacheDType>(cache_dtype);
    PKV_REQUIRE(isSupportedIODType(io), "io_dtype", io_dtype, supportedIODTypesText());
    PKV_REQUIRE(isSupportedCacheDType(cache), "cache_dtype", cache_dtype, supportedCacheDTypesText());
    attn::KernelShape multi{}, widths[attn::kNumDecodeWidths]{};
    cudaError_t err = cudaSuccess;
    for (int32_t i = 0; i < attn::kNumDecodeWidths && err == cudaSuccess; ++i)  // the first call names a bad head_dim
        err = attn::decodeKernelShape(io, cache, head_dim, attn::kDecodeWidthWarps[i], widths[i]);
    if (err == cudaSuccess) err = attn::multiKernelShape(io, cache, head_dim, multi);
    if (err != cudaSuccess) return err;
    int32_t const defaultWarps = attn::decodeDefaultWidth(cacheDTypeBytes(cache) == 1, head_dim);
    *out = PagedKVAttentionKernelShapes{0, 0, multi.threads, multi.smemBytes, {}, {}};
    for (int32_t i = 0; i < attn::kNumDecodeWidths; ++i) {
        out->decode_width_smem_bytes[i] = widths[i].smemBytes;
        out->decode_width_threads[i] = widths[i].threads;
        if (attn::kDecodeWidthWarps[i] != defaultWarps) continue;
        out->decode_threads = widths[i].threads;
        out->decode_smem_bytes = widths[i].smemBytes;
    }
    return 0;
}

int32_t pagedkv_attention_schedule_check(const AttentionParams* params, int64_t num_blocks, int32_t sm_count,
                                         const int32_t* decode_ctas_per_sm, int32_t multi_ctas_per_sm,
                                         int32_t decode_chunks, int32_t max_pos, int32_t* coverage,
                                         int32_t* direct_writes, int32_t* partial_writes, int32_t* merged_chunks,
                                         int32_t* poisoned) {
    clearLastError();
    attn::DeviceFacts facts{};
    attn::PlanSettings settings{};
    cudaError_t const bad =
        hostFacts(sm_count, decode_ctas_per_sm, multi_ctas_per_sm, decode_chunks, facts, settings);
    if (bad != cudaSuccess) return bad;
    PKV_REQUIRE(num_blocks >= 0, "num_blocks", num_blocks, ">= 0");
    PKV_REQUIRE(coverage && direct_writes && partial_writes && merged_chunks && poisoned, "outputs", 0,
                "five host arrays");
    AttentionParams p;
    cudaError_t const err = hostParams(params, p);  // the replay validates p as the launcher does
    if (err != cudaSuccess) return err;
    attn::ScheduleReplay const replay{max_pos, coverage, direct_writes, partial_writes, merged_chunks, poisoned};
    return attn::replayAttentionSchedule(p, num_blocks, facts, settings, replay);
}

}  // extern "C"
