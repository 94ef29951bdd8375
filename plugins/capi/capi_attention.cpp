// C API of paged attention: flat args -> AttentionParams (makeKVLayout from the geometry), then the launcher,
// the workspace size, the plan, or the host schedule replay. Geometry errors are reported here with the
// C field's name; everything else by the launcher's validation (before any CUDA call).
#include "capi_attention.h"

#include <cstddef>
#include <string>

#include "../kernels/attention_plan.h"
#include "../kernels/launch_common.h"
#include "pagedkv/attention.h"
#include "pagedkv/kv_layout.h"

namespace {

using namespace pagedkv;

// Stand-in for device pointers the plan and the replay never dereference (validation wants them set).
void* const kNotDereferenced = reinterpret_cast<void*>(uintptr_t(256));

cudaError_t toParams(PagedKVAttentionArgs const* a, AttentionParams& p) {
    if (a == nullptr) return invalidArgument("args=NULL: expected a PagedKVAttentionArgs");
    PKV_REQUIRE(a->struct_size == int32_t(sizeof(PagedKVAttentionArgs)), "struct_size", a->struct_size,
                "sizeof(PagedKVAttentionArgs)=" + std::to_string(sizeof(PagedKVAttentionArgs)) +
                    " (the caller's struct does not match this library)");
    PKV_REQUIRE(a->num_layers > 0, "num_layers", a->num_layers, "> 0");
    PKV_REQUIRE(a->num_kv_heads > 0, "num_kv_heads", a->num_kv_heads, "> 0");
    PKV_REQUIRE(a->head_dim > 0, "head_dim", a->head_dim, "one of 64, 128, 256");
    PKV_REQUIRE(a->page_size > 0, "page_size", a->page_size, "> 0");
    PKV_REQUIRE(a->page_layout == 0 || a->page_layout == 1, "page_layout", a->page_layout, "0 (HND) or 1 (NHD)");
    PKV_REQUIRE(a->ring_sink_tokens >= 0, "ring_sink_tokens", a->ring_sink_tokens, ">= 0");
    PKV_REQUIRE(a->cyclic_len >= 0 && a->cyclic_len % a->page_size == 0, "cyclic_len", a->cyclic_len,
                "0 or a multiple of page_size=" + std::to_string(a->page_size));
    PKV_REQUIRE(a->workspace_bytes >= 0, "workspace_bytes", a->workspace_bytes, ">= 0");
    PKV_REQUIRE(a->io_dtype == 0 || a->io_dtype == 1, "io_dtype", a->io_dtype, "0 (fp16) or 1 (bf16)");
    KVLayout layout;
    PKV_REQUIRE(makeKVLayout(a->num_layers, a->num_kv_heads, a->page_size, a->head_dim,
                             static_cast<PageLayout>(a->page_layout), a->ring_sink_tokens, a->cyclic_len, layout),
                "page_size", a->page_size, "a valid KV layout geometry");
    p = AttentionParams{};
    p.numQHeads = a->num_q_heads;
    p.numKVHeads = a->num_kv_heads;
    p.headDim = a->head_dim;
    p.ioDType = static_cast<IODType>(a->io_dtype);
    p.qFP8 = a->q_fp8 != 0;
    p.qScale = a->q_scale;
    p.q = a->q;
    p.meta.poolDescs = a->pool_descs;
    p.meta.poolIndex = a->pool_index;
    p.meta.blockTable = a->block_table;
    p.meta.maxBlocks = a->max_blocks;
    p.meta.cuQLens = a->cu_q_lens;
    p.meta.pastLens = a->past_lens;
    p.meta.numSeqs = a->num_seqs;
    p.meta.numTokens = a->num_tokens;
    p.maxQLen = a->max_q_len;
    p.maxKVLen = a->max_kv_len;
    p.layout = layout;
    p.cacheDType = static_cast<CacheDType>(a->cache_dtype);
    p.layer = a->layer;
    p.kScale = a->k_scale;
    p.vScale = a->v_scale;
    p.window = a->window;
    p.attentionSinks = a->attention_sinks;
    p.softmaxScale = a->softmax_scale;
    p.logitSoftcap = a->logit_softcap;
    p.out = a->out;
    p.workspace = a->workspace;
    p.workspaceBytes = size_t(a->workspace_bytes);
    return cudaSuccess;
}

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

}  // namespace

extern "C" {

int32_t pagedkv_attention_args_layout(int64_t* offsets, int32_t n) {
#define PKV_FIELD(name) int64_t(offsetof(PagedKVAttentionArgs, name))
    int64_t const fields[] = {
        PKV_FIELD(struct_size), PKV_FIELD(num_q_heads), PKV_FIELD(num_kv_heads), PKV_FIELD(head_dim),
        PKV_FIELD(io_dtype), PKV_FIELD(q_fp8), PKV_FIELD(q_scale), PKV_FIELD(num_tokens), PKV_FIELD(num_seqs),
        PKV_FIELD(max_blocks), PKV_FIELD(pool_index), PKV_FIELD(max_q_len), PKV_FIELD(max_kv_len),
        PKV_FIELD(reserved0), PKV_FIELD(pool_descs), PKV_FIELD(block_table), PKV_FIELD(cu_q_lens),
        PKV_FIELD(past_lens), PKV_FIELD(q), PKV_FIELD(num_layers), PKV_FIELD(page_size), PKV_FIELD(page_layout),
        PKV_FIELD(ring_sink_tokens), PKV_FIELD(cyclic_len), PKV_FIELD(layer), PKV_FIELD(cache_dtype),
        PKV_FIELD(k_scale), PKV_FIELD(v_scale), PKV_FIELD(window), PKV_FIELD(attention_sinks),
        PKV_FIELD(softmax_scale), PKV_FIELD(logit_softcap), PKV_FIELD(reserved1), PKV_FIELD(out),
        PKV_FIELD(workspace), PKV_FIELD(workspace_bytes)};
#undef PKV_FIELD
    int32_t const count = int32_t(sizeof(fields) / sizeof(fields[0]));
    if (offsets == nullptr || n < count) return -1;
    for (int32_t i = 0; i < count; ++i) offsets[i] = fields[i];
    return count;
}

int32_t pagedkv_attention(const PagedKVAttentionArgs* args, cudaStream_t stream) {
    AttentionParams p;
    cudaError_t err = toParams(args, p);
    if (err != cudaSuccess) return err;
    return launchAttention(p, stream);
}

int64_t pagedkv_attention_workspace_bytes(int32_t num_tokens, int32_t num_seqs, int32_t num_q_heads, int32_t head_dim,
                                          int32_t max_kv_len, int32_t page_size) {
    auto fail = [](std::string msg) -> int64_t {
        invalidArgument(std::move(msg));
        return -1;
    };
    if (num_tokens < 0) return fail("num_tokens=" + std::to_string(num_tokens) + ": expected >= 0");
    if (num_seqs < 0) return fail("num_seqs=" + std::to_string(num_seqs) + ": expected >= 0");
    if (num_q_heads <= 0) return fail("num_q_heads=" + std::to_string(num_q_heads) + ": expected > 0");
    if (head_dim != 64 && head_dim != 128 && head_dim != 256)
        return fail("head_dim=" + std::to_string(head_dim) + ": expected one of 64, 128, 256");
    if (max_kv_len < 0) return fail("max_kv_len=" + std::to_string(max_kv_len) + ": expected >= 0");
    if (page_size <= 0) return fail("page_size=" + std::to_string(page_size) + ": expected > 0");
    return int64_t(attentionWorkspaceBytes(num_tokens, num_seqs, num_q_heads, head_dim, max_kv_len, page_size));
}

int32_t pagedkv_attention_plan(const PagedKVAttentionArgs* args, int32_t sm_count, int32_t decode_ctas_per_sm,
                               int32_t multi_ctas_per_sm, PagedKVAttentionPlanInfo* out) {
    if (out == nullptr) return invalidArgument("out=NULL: expected a PagedKVAttentionPlanInfo");
    PKV_REQUIRE(out->struct_size == int32_t(sizeof(PagedKVAttentionPlanInfo)), "out.struct_size", out->struct_size,
                "sizeof(PagedKVAttentionPlanInfo)=" + std::to_string(sizeof(PagedKVAttentionPlanInfo)));
    PKV_REQUIRE(sm_count > 0, "sm_count", sm_count, "> 0");
    PKV_REQUIRE(decode_ctas_per_sm > 0, "decode_ctas_per_sm", decode_ctas_per_sm, "> 0");
    PKV_REQUIRE(multi_ctas_per_sm > 0, "multi_ctas_per_sm", multi_ctas_per_sm, "> 0");
    AttentionParams p;
    cudaError_t err = toParams(args, p);
    if (err != cudaSuccess) return err;
    fillStandIns(p);
    err = attn::validateAttentionParams(p);
    if (err != cudaSuccess) return err;
    attn::AttentionPlan const plan = attn::planAttention(p, attn::DeviceFacts{sm_count, decode_ctas_per_sm, multi_ctas_per_sm});
    int32_t const size = out->struct_size;
    *out = PagedKVAttentionPlanInfo{};
    out->struct_size = size;
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
    return 0;
}

int32_t pagedkv_attention_schedule_check(const PagedKVAttentionArgs* args, int64_t num_blocks, int32_t sm_count,
                                         int32_t decode_ctas_per_sm, int32_t multi_ctas_per_sm, int32_t max_pos,
                                         int32_t* coverage, int32_t* direct_writes, int32_t* partial_writes,
                                         int32_t* merged_chunks, int32_t* poisoned) {
    PKV_REQUIRE(sm_count > 0, "sm_count", sm_count, "> 0");
    PKV_REQUIRE(decode_ctas_per_sm > 0, "decode_ctas_per_sm", decode_ctas_per_sm, "> 0");
    PKV_REQUIRE(multi_ctas_per_sm > 0, "multi_ctas_per_sm", multi_ctas_per_sm, "> 0");
    PKV_REQUIRE(num_blocks >= 0, "num_blocks", num_blocks, ">= 0");
    PKV_REQUIRE(coverage && direct_writes && partial_writes && merged_chunks && poisoned, "outputs", 0,
                "five host arrays");
    AttentionParams p;
    cudaError_t err = toParams(args, p);
    if (err != cudaSuccess) return err;
    fillStandIns(p);
    attn::ScheduleReplay const replay{max_pos, coverage, direct_writes, partial_writes, merged_chunks, poisoned};
    return attn::replayAttentionSchedule(p, num_blocks,
                                         attn::DeviceFacts{sm_count, decode_ctas_per_sm, multi_ctas_per_sm}, replay);
}

}  // extern "C"
