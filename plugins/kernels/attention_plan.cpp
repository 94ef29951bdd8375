#include "attention_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "launch_common.h"
#include "pagedkv/capabilities.h"
#include "pagedkv/kv_layout_check.h"

namespace pagedkv {
namespace attn {
namespace {

bool finitePositive(float x) { return std::isfinite(x) && x > 0.f; }
bool aligned16(void const* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }
int64_t ceilDiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t roundUp64(int64_t a, int64_t b) { return ceilDiv64(a, b) * b; }

// Decode split model (planAttention): a CTA's fixed cost (metadata, page lookups, pipeline fill, combine)
// in KV tokens of streaming time, and the most waves worth considering (beyond that a split only adds
// chunks and merge work).
constexpr int64_t kDecodeCtaCostTokens = 64;
constexpr int64_t kDecodeMaxWaves = 4;
// Decode CTA width (planAttention): 2-warp CTAs take over from the default 4-warp ones when the unsplit 4-warp grid
// runs more than this many half waves (1.5 waves). Measured on the H200 (D = 128, 8 KV heads; NOTES-attention.md):
// at 3.88 and 7.76 waves (128 x 2K, 256 x 1K) 2 warps 1.2-1.8 % faster; at 1.94 waves (64 x 4K) 2 warps 0.7 %
// slower before the loads' .L2::128B hint, 0.8-1.4 % faster in the five sweeps since.
constexpr int64_t kDecodeNarrowAfterHalfWaves = 3;

cudaError_t validate(AttentionParams const& p) {
    PKV_REQUIRE(p.numQHeads > 0, "num_q_heads", p.numQHeads, "> 0");
    PKV_REQUIRE(p.numKVHeads > 0 && p.numKVHeads <= kMaxAttentionKVHeads, "num_kv_heads", p.numKVHeads,
                "in [1, " + std::to_string(kMaxAttentionKVHeads) + "]");
    PKV_REQUIRE(p.numQHeads % p.numKVHeads == 0, "num_q_heads", p.numQHeads,
                "a multiple of num_kv_heads=" + std::to_string(p.numKVHeads));
    PKV_REQUIRE(isSupportedHeadDim(p.headDim), "head_dim", p.headDim, std::string("one of ") + supportedHeadDimsText());
    int32_t io = static_cast<int32_t>(p.ioDType);
    PKV_REQUIRE(isSupportedIODType(p.ioDType), "io_dtype", io, supportedIODTypesText());
    int32_t cache = static_cast<int32_t>(p.cacheDType);
    PKV_REQUIRE(isSupportedCacheDType(p.cacheDType), "cache_dtype", cache, supportedCacheDTypesText());
    bool cache16 = p.cacheDType == CacheDType::kFP16 || p.cacheDType == CacheDType::kBF16;
    if (cache16) {
        // 16-bit caches feed the tensor cores as stored: the queries must have the same type.
        bool same = (p.cacheDType == CacheDType::kFP16) == (p.ioDType == IODType::kFP16);
        PKV_REQUIRE(same, "cache_dtype", cache,
                    "the 16-bit type of io_dtype=" + std::to_string(io) + " (a 16-bit cache is read as stored)");
    } else {
        PKV_REQUIRE(finitePositive(p.kScale), "k_scale", p.kScale, "finite and > 0 for a quantized cache");
        PKV_REQUIRE(finitePositive(p.vScale), "v_scale", p.vScale, "finite and > 0 for a quantized cache");
    }
    if (p.qFP8) PKV_REQUIRE(finitePositive(p.qScale), "q_scale", p.qScale, "finite and > 0 with q_fp8");
    PKV_REQUIRE(std::isfinite(p.softmaxScale) && p.softmaxScale >= 0.f, "softmax_scale", p.softmaxScale,
                "finite and >= 0 (0 means 1/sqrt(head_dim))");
    PKV_REQUIRE(std::isfinite(p.logitSoftcap) && p.logitSoftcap >= 0.f, "logit_softcap", p.logitSoftcap,
                "finite and >= 0 (0: no soft-cap)");
    PKV_REQUIRE(p.attentionSinks >= 0, "attention_sinks", p.attentionSinks, ">= 0");
    if (FieldIssue const bad = checkKVLayoutFor(p.layout, p.numKVHeads, p.headDim, p.layer)) return invalidField(bad);

    StepMetadata const& m = p.meta;
    PKV_REQUIRE(m.numTokens >= 0, "num_tokens", m.numTokens, ">= 0");
    PKV_REQUIRE(m.numSeqs >= 0, "num_seqs", m.numSeqs, ">= 0");
    PKV_REQUIRE(m.numSeqs > 0 || m.numTokens == 0, "num_tokens", m.numTokens, "0 when num_seqs=0");
    PKV_REQUIRE(int64_t(m.numTokens) * p.numQHeads <= INT32_MAX, "num_tokens", m.numTokens,
                "num_tokens * num_q_heads < 2^31");
    if (m.numTokens == 0) return cudaSuccess;  // nothing to compute; nothing is dereferenced

    PKV_REQUIRE(p.q != nullptr, "q", 0, "a device pointer");
    PKV_REQUIRE(aligned16(p.q), "q", reinterpret_cast<uintptr_t>(p.q), "a 16-byte aligned address");
    PKV_REQUIRE(p.out != nullptr, "out", 0, "a device pointer");
    PKV_REQUIRE(aligned16(p.out), "out", reinterpret_cast<uintptr_t>(p.out), "a 16-byte aligned address");
    PKV_REQUIRE(m.poolDescs != nullptr, "pool_descs", 0, "a device pointer");
    PKV_REQUIRE(m.poolIndex >= 0, "pool_index", m.poolIndex, ">= 0");
    PKV_REQUIRE(m.cuQLens != nullptr, "cu_q_lens", 0, "a device pointer");
    PKV_REQUIRE(m.pastLens != nullptr, "past_lens", 0, "a device pointer");
    PKV_REQUIRE(m.maxBlocks >= 0, "max_blocks", m.maxBlocks, ">= 0");
    PKV_REQUIRE(m.maxBlocks == 0 || m.blockTable != nullptr, "block_table", 0, "a device pointer when max_blocks > 0");
    PKV_REQUIRE(p.maxQLen >= 1 && p.maxQLen <= m.numTokens, "max_q_len", p.maxQLen,
                "in [1, num_tokens=" + std::to_string(m.numTokens) + "]");
    PKV_REQUIRE(p.maxKVLen >= 0, "max_kv_len", p.maxKVLen, ">= 0");
    PKV_REQUIRE(p.workspaceBytes == 0 || p.workspace != nullptr, "workspace", 0,
                "a device pointer when workspace_bytes=" + std::to_string(p.workspaceBytes) + " > 0");
    PKV_REQUIRE(aligned16(p.workspace), "workspace", reinterpret_cast<uintptr_t>(p.workspace),
                "a 16-byte aligned address");
    return cudaSuccess;
}

}  // namespace

cudaError_t validateAttentionParams(AttentionParams const& p) { return validate(p); }

AttentionPlan planAttention(AttentionParams const& p, DeviceFacts const& facts, PlanSettings const& settings) {
    AttentionPlan plan{};
    int32_t const T = p.meta.numTokens, B = p.meta.numSeqs, H = p.numQHeads, KVH = p.numKVHeads, D = p.headDim;
    int32_t const G = H / KVH;
    plan.groupSize = G;
    plan.multiTileRows = facts.multiTileRows > 0 ? facts.multiTileRows : multiTileRows(D);
    plan.split.decodeChunkLen = plan.split.multiChunkLen = kChunkAlign;
    plan.split.decodeGridChunks = plan.split.multiGridChunks = 1;
    plan.kvRowMapOffset = -1;
    if (T == 0) return plan;

    // Bound on any sequence's KV span: the cache length, or with a window the window of the first query
    // plus the step's other queries plus the sinks. Only sizes the split; the kernels never rely on it.
    int64_t maxSpan = std::max<int64_t>(p.maxKVLen, 1);
    if (p.window > 0) maxSpan = std::min<int64_t>(maxSpan, int64_t(p.window) + p.maxQLen - 1 + p.attentionSinks);
    maxSpan = std::min<int64_t>(maxSpan, INT32_MAX - kChunkAlign);
    plan.maxSpan = int32_t(maxSpan);

    // The KV row maps of the Hopper multi-token kernel take the workspace's last kKVRowMapRegionBytes when they fit
    // (whichever kernels run: a workspace sized by attentionWorkspaceBytes then leaves the partials exactly the room
    // it counted for them); the partials get what is before them.
    int64_t partialRoom = int64_t(p.workspaceBytes);
    if (p.workspaceBytes >= kKVRowMapRegionBytes) {
        partialRoom = int64_t(p.workspaceBytes - kKVRowMapRegionBytes) / int64_t(kKVRowMapBytes) *
                      int64_t(kKVRowMapBytes);
        plan.kvRowMapOffset = partialRoom;
    }
    int64_t const rowBytes = int64_t(D + 1) * int64_t(sizeof(float));  // one partial row: D outputs + its LSE
    int64_t const wsChunks = partialRoom / (int64_t(T) * H * rowBytes);
    int64_t const spanChunks = ceilDiv64(maxSpan, kMinChunkTokens);
    int64_t const smCount = std::max(facts.smCount, 1);
    // The most chunks any split may cut a span into: the span's chunks, the workspace's partial rows, the grid.
    int64_t const chunkBound = std::min({spanChunks, wsChunks, int64_t(kMaxGridChunks)});

    // Split-K of the multi-token kernel: when its CTAs can't fill `waves` waves of the GPU, cut every
    // sequence's span into chunks so that they can (bounded by the span, the workspace and the grid).
    auto chunkLenFor = [&](int32_t n) { return int32_t(roundUp64(ceilDiv64(maxSpan, n), kChunkAlign)); };
    auto chooseChunks = [&](int64_t units, int64_t ctasPerSm, int64_t waves) -> int32_t {
        int64_t capacity = smCount * std::max<int64_t>(ctasPerSm, 1) * waves;
        if (units >= capacity) return 1;
        int64_t want = ceilDiv64(capacity, std::max<int64_t>(units, 1));
        int64_t n = std::min(want, chunkBound);
        return int32_t(std::max<int64_t>(n, 1));
    };
    auto gridChunksFor = [&](int32_t n, int32_t len) { return n <= 1 ? 1 : int32_t(ceilDiv64(maxSpan, len)); };

    // Decode kernel: every sequence x KV head is one unit (sequences of the other class exit at once).
    // The kernel is memory-bound and its CTAs of one plan carry equal work (the longest span), so a wave
    // that is only partly filled costs about as much as a full one (measured on the H200: 16 x 8K with 5
    // chunks = 640 CTAs = 2.42 waves of 264 ran at 75 % of the copy ceiling, 128 x 2K = 3.88 waves at 92 %).
    // Pick the chunk count with the least modeled time: waves x (chunk tokens + a per-CTA fixed cost),
    // ties to fewer chunks (less merge work, fewer prologues).
    auto chooseDecodeChunks = [&](int64_t units, int64_t ctasPerSm) -> int32_t {
        int64_t const slots = smCount * std::max<int64_t>(ctasPerSm, 1);
        int64_t const nMax = std::min(chunkBound, ceilDiv64(kDecodeMaxWaves * slots, std::max<int64_t>(units, 1)));
        int32_t best = 1;
        int64_t bestCost = ceilDiv64(units, slots) * (int64_t(maxSpan) + kDecodeCtaCostTokens);
        for (int64_t n = 2; n <= nMax; ++n) {
            int32_t const len = chunkLenFor(int32_t(n));
            int64_t const grid = ceilDiv64(maxSpan, len);  // chunks the grid really has after rounding
            if (grid <= 1) continue;
            int64_t const cost = ceilDiv64(units * grid, slots) * (int64_t(len) + kDecodeCtaCostTokens);
            if (cost < bestCost) bestCost = cost, best = int32_t(n);
        }
        return best;
    };
    // The CTA width (warps), among those the facts offer (compiled for the instance, fitting the device). Every
    // width keeps ~8 decode warps on an SM; what differs is how the work is cut (measured on the H200,
    // NOTES-attention.md): the default 4 warps, unless
    //   - 8 warps run the batch unsplit where 4 would split it: no merge, no partial rows (16 x 8K: 2-3 % faster);
    //   - the unsplit 4-warp grid runs more than 1.5 waves (kDecodeNarrowAfterHalfWaves) and 2 warps need no split
    //     either: 2 warps (64 x 4K: ~1 %, 128 x 2K, 256 x 1K: 1-2 % faster).
    // Without the default width (sm_89 hosts the 16-bit D = 128 kernel only at 2 warps), the narrowest offered.
    // Returns the width's index in kDecodeWidthWarps.
    auto chooseDecodeWidth = [&](int64_t units) -> int32_t {
        static_assert(kDecodeWidthWarps[0] == 2 && kDecodeWidthWarps[1] == kDecodeWarps && kDecodeWidthWarps[2] == 8,
                      "the widths in the order the rule reads them");
        int32_t const narrow = facts.decodeCtasPerSm[0], standard = facts.decodeCtasPerSm[1],
                      wide = facts.decodeCtasPerSm[2];
        if (standard <= 0 && narrow > 0) return 0;
        if (standard <= 0 && wide > 0) return 2;
        if (standard <= 0) return 1;  // a plan before the facts
        bool const standardSplits = chooseDecodeChunks(units, standard) > 1;
        if (wide > 0 && standardSplits && chooseDecodeChunks(units, wide) == 1) return 2;
        if (narrow > 0 && !standardSplits && 2 * units > kDecodeNarrowAfterHalfWaves * smCount * standard &&
            chooseDecodeChunks(units, narrow) == 1)
            return 0;
        return 1;
    };
    plan.runDecode = G <= kDecodeRows;
    if (plan.runDecode) {
        int64_t const units = int64_t(B) * KVH;
        int32_t const width = chooseDecodeWidth(units);
        // A forced chunk count (PlanSettings) within the bounds the model's choice also keeps.
        int32_t const n = settings.decodeChunks > 0
                              ? int32_t(std::max<int64_t>(1, std::min(int64_t(settings.decodeChunks), chunkBound)))
                              : chooseDecodeChunks(units, facts.decodeCtasPerSm[width]);
        plan.decodeWarps = kDecodeWidthWarps[width];
        plan.split.decodeChunkLen = chunkLenFor(n);
        plan.split.decodeGridChunks = gridChunksFor(n, plan.split.decodeChunkLen);
        plan.decodeGrid = dim3(uint32_t(B), uint32_t(KVH), uint32_t(plan.split.decodeGridChunks));
    }

    // Multi-token kernel: launched when some sequence may have more rows than one decode tile.
    plan.runMulti = G > kDecodeRows || int64_t(p.maxQLen) * G > kDecodeRows;
    plan.split.multiLaunched = plan.runMulti ? 1 : 0;
    if (plan.runMulti) {
        int32_t bodyTiles = numBodyTiles(T, G, plan.multiTileRows);
        plan.split.multiBodyTiles = bodyTiles;
        int64_t units = int64_t(std::max(bodyTiles, std::min(B, T))) * KVH;
        int32_t n = chooseChunks(units, facts.multiCtasPerSm, 1);
        plan.split.multiChunkLen = chunkLenFor(n);
        plan.split.multiGridChunks = gridChunksFor(n, plan.split.multiChunkLen);
        plan.multiGrid = dim3(uint32_t(bodyTiles + B), uint32_t(KVH), uint32_t(plan.split.multiGridChunks));
    }

    int32_t chunks = 1;
    if (plan.runDecode) chunks = std::max(chunks, plan.split.decodeGridChunks);
    if (plan.runMulti) chunks = std::max(chunks, plan.split.multiGridChunks);
    plan.runMerge = chunks > 1;
    plan.partialChunks = plan.runMerge ? chunks : 0;
    plan.workspaceBytes = plan.runMerge ? size_t(int64_t(chunks) * T * H * rowBytes) : 0;
    int64_t rows = int64_t(T) * H;
    // One CTA (4 warps over the chunks) per (token, head) row: a long split's chunks are read in one batch
    // per warp (attention_merge.cu). rows <= INT32_MAX (validated: numTokens * numQHeads < 2^31).
    plan.mergeGrid = dim3(uint32_t(rows), 1, 1);
    return plan;
}

}  // namespace attn

size_t attentionWorkspaceBytes(int32_t numTokens, int32_t numSeqs, int32_t numQHeads, int32_t headDim,
                               int32_t maxKVLen, int32_t pageSize) {
    // Invalid bounds size nothing; launchAttention reports them with the field and the value.
    if (numTokens < 0 || numSeqs < 0 || numQHeads <= 0 || maxKVLen < 0 || pageSize <= 0) return 0;
    if (!isSupportedHeadDim(headDim)) return 0;
    int64_t rows = int64_t(numTokens) * numQHeads;
    if (rows == 0) return 0;
    int64_t spanChunks = (std::max<int64_t>(maxKVLen, 1) + attn::kMinChunkTokens - 1) / attn::kMinChunkTokens;
    int64_t chunks = std::min<int64_t>(spanChunks, attn::kMaxGridChunks);
    // The plan splits only while chunks * T * H partial rows fit; the budget does not grow with T, so a
    // profile sized for long prefills still lets a short decode step split. Then the KV row maps' region
    // (attention_plan.h), on a 128-byte boundary after the partials.
    int64_t partialRows = chunks <= 1 ? 0 : std::min(rows * chunks, attn::kMaxPartialRows);
    size_t const partials = size_t(partialRows) * size_t(headDim + 1) * sizeof(float);
    size_t const aligned = (partials + attn::kKVRowMapBytes - 1) / attn::kKVRowMapBytes * attn::kKVRowMapBytes;
    return aligned + attn::kKVRowMapRegionBytes;
}

}  // namespace pagedkv
