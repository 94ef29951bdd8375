// Host replay of the attention kernels' work decomposition: the same plan (planAttention) and the same
// per-CTA decisions (decodeCtaWork / multiCtaWork / kvRowAt / tileNeedsMask / seqChunks, attention_schedule.h)
// the kernels execute, walked on the CPU over every CTA of both grids. It records which (query row, kv
// position) pairs enter a softmax and which rows get written where, so the CPU tests can prove, without a
// GPU, that every visible pair is counted exactly once and every output row is produced exactly once.
#include <cstring>
#include <string>
#include <vector>

#include "attention_plan.h"
#include "launch_common.h"

namespace pagedkv {
namespace attn {

cudaError_t replayAttentionSchedule(AttentionParams const& p, int64_t numBlocks, DeviceFacts const& facts,
                                    PlanSettings const& settings, ScheduleReplay const& out) {
    cudaError_t err = validateAttentionParams(p);
    if (err != cudaSuccess) return err;
    int32_t const T = p.meta.numTokens, B = p.meta.numSeqs, H = p.numQHeads, D = p.headDim;
    PKV_REQUIRE(out.maxPos > 0, "max_pos", out.maxPos, "> 0");
    int64_t const rows = int64_t(T) * H;
    std::memset(out.coverage, 0, size_t(rows) * size_t(out.maxPos) * sizeof(int32_t));
    for (int32_t* a : {out.directWrites, out.partialWrites, out.mergedChunks, out.poisoned})
        std::memset(a, 0, size_t(rows) * sizeof(int32_t));
    if (T == 0) return cudaSuccess;

    AttentionPlan const plan = planAttention(p, facts, settings);
    int32_t const G = plan.groupSize;
    int32_t const MB = p.meta.maxBlocks;
    StepView const view{p.meta.cuQLens, p.meta.pastLens, B, G, p.window, p.attentionSinks};
    std::vector<uint8_t> partialSeen(size_t(plan.partialChunks) * size_t(rows), 0);

    auto rowIndex = [&](int32_t row, int32_t kvHead) -> int64_t {
        return int64_t(row / G) * H + kvHead * G + row % G;
    };
    auto count = [&](int32_t row, int32_t kvHead, int32_t pos) -> cudaError_t {
        PKV_REQUIRE(pos >= 0 && pos < out.maxPos, "kv position", pos,
                    "< max_pos=" + std::to_string(out.maxPos) + " (a softmax saw a position outside the caches)");
        ++out.coverage[rowIndex(row, kvHead) * out.maxPos + pos];
        return cudaSuccess;
    };
    auto recordWrites = [&](CtaWork const& w, int32_t kvHead, int32_t z) -> cudaError_t {
        for (int32_t row = w.rowBegin; row < w.rowEnd; ++row) {
            int64_t const r = rowIndex(row, kvHead);
            if (w.nChunks == 1) {
                ++out.directWrites[r];
                continue;
            }
            PKV_REQUIRE(z < plan.partialChunks, "chunk", z,
                        "< partialChunks=" + std::to_string(plan.partialChunks) + " (workspace overflow)");
            uint8_t& seen = partialSeen[size_t(z) * size_t(rows) + size_t(r)];
            PKV_REQUIRE(!seen, "chunk", z, "written once per row (row " + std::to_string(r) + " twice)");
            seen = 1;
            ++out.partialWrites[r];
        }
        return cudaSuccess;
    };
    auto tableOf = [&](int32_t seq) {
        return BlockTableRow{p.meta.blockTable + int64_t(seq) * MB, MB, numBlocks};
    };

    if (plan.runDecode) {
        for (uint32_t z = 0; z < plan.decodeGrid.z; ++z)
            for (uint32_t kvHead = 0; kvHead < plan.decodeGrid.y; ++kvHead)
                for (uint32_t b = 0; b < plan.decodeGrid.x; ++b) {
                    CtaWork const w = decodeCtaWork(plan.split, view, int32_t(b), int32_t(z));
                    if (w.poison)
                        for (int32_t row = w.rowBegin; row < w.rowEnd; ++row) ++out.poisoned[rowIndex(row, kvHead)];
                    if (!w.active) continue;
                    PKV_REQUIRE(w.rowEnd - w.rowBegin <= kDecodeRows, "decode CTA rows", w.rowEnd - w.rowBegin,
                                "<= 16");
                    BlockTableRow const table = tableOf(w.seqIndex);
                    int32_t const warps = plan.decodeWarps;  // warp w streams tiles w, w + warps, ...
                    for (int32_t warp = 0; warp < warps; ++warp)
                        for (int32_t k = warp; k < w.tiles.count(); k += warps)
                            for (int32_t r = 0; r < kDecodeTileTokens; ++r) {
                                int32_t const v = w.tiles.tile(k) * kDecodeTileTokens + r;
                                KVRow const kv = kvRowAt(p.layout, table, w.span, w.chunk, v);
                                for (int32_t row = w.rowBegin; row < w.rowEnd; ++row)
                                    if (kvVisible(rowQueryPos(w.seq, row, G), kv.pos, p.window, p.attentionSinks)) {
                                        err = count(row, int32_t(kvHead), kv.pos);
                                        if (err != cudaSuccess) return err;
                                    }
                            }
                    err = recordWrites(w, int32_t(kvHead), int32_t(z));
                    if (err != cudaSuccess) return err;
                }
    }

    if (plan.runMulti) {
        int32_t const tileTokens = multiTileTokens(D);
        std::vector<KVRow> tile(static_cast<size_t>(tileTokens));
        // The cells walked as the persistent Hopper kernel walks them (persistentDeal, one wave of CTAs); the other
        // multi-token kernels run one CTA per cell, which covers the same cells. Every cell exactly once:
        int64_t const cells = int64_t(plan.multiGrid.x) * plan.multiGrid.y * plan.multiGrid.z;
        std::vector<uint8_t> dealt(static_cast<size_t>(cells), 0);
        int32_t const ctas = persistentCtas(cells, facts.smCount, facts.multiCtasPerSm);
        // The Hopper kernel's CTAs end at once where no thread sees a multi-token sequence: exact only if no cell of
        // such a step has work, which the walk below checks.
        bool const stepHasMulti = seesMultiTokenSequence(view, 0, 1);  // one thread sees every sequence
        for (int32_t cta = 0; cta < ctas; ++cta) {
            PersistentDeal deal = persistentDeal(plan.split, B, p.numKVHeads, ctas, cta);
            MultiCell cell{};
            while (deal.next(cell)) {
                PKV_REQUIRE(cell.slot >= 0 && uint32_t(cell.slot) < plan.multiGrid.x && cell.kvHead >= 0 &&
                                uint32_t(cell.kvHead) < plan.multiGrid.y && cell.z >= 0 &&
                                uint32_t(cell.z) < plan.multiGrid.z,
                            "persistent cell", cell.slot, "inside the grid");
                uint8_t& once = dealt[(size_t(cell.z) * plan.multiGrid.y + size_t(cell.kvHead)) * plan.multiGrid.x +
                                      size_t(cell.slot)];
                PKV_REQUIRE(!once, "persistent cell", cell.slot, "dealt once (CTA " + std::to_string(cta) + ")");
                once = 1;
                CtaWork const w = multiCtaWork(plan.split, view, plan.multiTileRows, tileTokens, cell.slot, cell.z);
                if (!w.active) continue;
                PKV_REQUIRE(stepHasMulti, "multi-token cell", cell.slot,
                            "active only in a step with a multi-token sequence (the Hopper kernel's early exit)");
                BlockTableRow const table = tableOf(w.seqIndex);
                int32_t const qa = rowQueryPos(w.seq, w.rowBegin, G);
                int32_t const qb = rowQueryPos(w.seq, w.rowEnd - 1, G);
                for (int32_t k = 0; k < w.tiles.count(); ++k) {
                    bool holdsAll = true;
                    for (int32_t r = 0; r < tileTokens; ++r) {
                        tile[r] = kvRowAt(p.layout, table, w.span, w.chunk, w.tiles.tile(k) * tileTokens + r);
                        holdsAll = holdsAll && tile[r].pos >= 0;
                    }
                    bool const needMask =
                        tileNeedsMask(holdsAll, tile[0].pos, tile[tileTokens - 1].pos, qa, qb, p.window);
                    for (int32_t row = w.rowBegin; row < w.rowEnd; ++row) {
                        int32_t const qPos = rowQueryPos(w.seq, row, G);
                        for (int32_t r = 0; r < tileTokens; ++r)
                            if (!needMask || kvVisible(qPos, tile[r].pos, p.window, p.attentionSinks)) {
                                err = count(row, cell.kvHead, tile[r].pos);
                                if (err != cudaSuccess) return err;
                            }
                    }
                }
                err = recordWrites(w, cell.kvHead, cell.z);
                if (err != cudaSuccess) return err;
            }
        }
        for (int64_t c = 0; c < cells; ++c) PKV_REQUIRE(dealt[size_t(c)], "persistent cell", c, "dealt to some CTA");
    }

    if (plan.runMerge) {
        for (int32_t t = 0; t < T; ++t) {
            SeqInfo const s = makeSeqInfo(p.meta.cuQLens, p.meta.pastLens, seqOfToken(p.meta.cuQLens, B, t));
            int32_t const n = seqChunks(plan.split, s, G, p.window, p.attentionSinks);
            for (int32_t h = 0; h < H; ++h) out.mergedChunks[int64_t(t) * H + h] = n > 1 ? n : 0;
        }
    }
    return cudaSuccess;
}

}  // namespace attn
}  // namespace pagedkv
