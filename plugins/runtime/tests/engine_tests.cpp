// Unit tests of the runtime above the KV manager: SplitMix64 draws (the reference generator's published
// outputs), the copy plan's geometry, all-or-nothing reserveMany, the scheduler's steps (chunked prefill,
// decodes first, preemption by recompute and by swap), the engine's step inputs against hand-computed arrays,
// stops (EOS, stop tokens, ignore_eos, max_new_tokens), streaming callbacks, abort, penalties and request
// checks, and every request's tokens batched equal its tokens alone. The model is a HostExecutor function
// (a token per logits row from its last input token and its uniform draw): no device.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "check.h"
#include "pagedkv/runtime/copy_plan.h"
#include "pagedkv/runtime/engine.h"
#include "pool_groups.h"

namespace pagedkv::runtime::check {
namespace {

constexpr int32_t kVocab = 50;

// Token of a logits row: a function of the row's last input token and its draw (so a request's tokens depend
// on its own history and seed only, whatever it is batched with).
void model(HostStep const& step, std::vector<int32_t>& tokens, std::vector<float>& logprobs, std::vector<int32_t>&,
           std::vector<float>&) {
    for (int32_t r = 0; r < step.shape.numRows; ++r) {
        int64_t const last = step.inputs.inputIds[step.inputs.logitsRows[r]];
        float const u = step.inputs.samplingParams[r * engine_io::kSamplingFields + engine_io::kSamplingUniform];
        tokens[r] = int32_t((last * 7 + int64_t(std::floor(double(u) * 997))) % kVocab);
        logprobs[r] = -u;
    }
}

PoolGroup group(int32_t page = 4) { return makePoolGroup(groupParams("g", 2, 2, page, 8)); }

HostExecutor executor(int64_t blocks, int64_t hostBlocks = 0, bool prefix = false, int32_t staticMaxBlocks = 0) {
    ModelInfo m;
    m.vocab = kVocab;
    m.numTopLogprobs = 2;
    m.staticMaxBlocks = staticMaxBlocks;
    return HostExecutor(KVManager({group()}, {blocks}, {hostBlocks}, prefix), m, model);
}

EngineConfig config(int32_t seqs, int32_t tokens, int32_t chunk, Preemption preemption = Preemption::kRecompute) {
    EngineConfig c;
    c.scheduler.maxNumSeqs = seqs;
    c.scheduler.maxNumBatchedTokens = tokens;
    c.scheduler.chunkSize = chunk;
    c.scheduler.preemption = preemption;
    c.eosTokenIds = {};
    return c;
}

std::vector<int32_t> iota(int32_t n, int32_t from = 1) {
    std::vector<int32_t> v(n);
    for (int32_t i = 0; i < n; ++i) v[i] = (from + i) % kVocab;
    return v;
}

SamplingParams tokensAtMost(int32_t n) {
    SamplingParams p;
    p.maxNewTokens = n;
    p.ignoreEos = true;
    return p;
}

// (request id, new tokens) of a scheduled step, decodes first.
std::vector<std::pair<RequestId, int32_t>> scheduleOf(Engine const& e) {
    std::vector<std::pair<RequestId, int32_t>> out;
    for (Request const* r : e.scheduledStep().decodes) out.emplace_back(r->id, 1);
    for (auto const& [r, n] : e.scheduledStep().prefills) out.emplace_back(r->id, n);
    return out;
}

// Outputs of every request of `prompts` run to the end on one engine.
std::map<RequestId, std::vector<int32_t>> runAll(HostExecutor& ex, EngineConfig const& cfg,
                                                 std::map<RequestId, std::vector<int32_t>> const& prompts,
                                                 int32_t maxNew, SchedulerStats* stats = nullptr) {
    Engine e(ex, cfg);
    for (auto const& [id, prompt] : prompts) {
        SamplingParams p = tokensAtMost(maxNew);
        p.seed = 1000 + id;  // (a derived seed would depend on the arrival)
        e.addRequest(id, prompt, p);
    }
    e.run();
    std::map<RequestId, std::vector<int32_t>> out;
    for (auto& r : e.takeFinished()) out[r->id] = r->output;
    if (stats) *stats = e.scheduler().stats();
    ex.kv().validate();
    return out;
}

}  // namespace

PKV_TEST(splitmix64_gives_the_reference_generators_outputs) {
    // SplitMix64 seeded 0 (Vigna's splitmix64.c): its first three outputs.
    EXPECT_EQ(splitmix64(0), 0xE220A8397B1DCDAFull);
    EXPECT_EQ(splitmix64(kSplitMixGolden), 0x6E789E6AA1B965F4ull);
    EXPECT_EQ(splitmix64(2 * kSplitMixGolden), 0x06C45D188009454Full);
    EXPECT_EQ(uniformDraw(0, 1), double(0x6E789E6AA1B965F4ull >> 11) * 0x1p-53);
    EXPECT_EQ(deriveSeed(5, 3), splitmix64(5 + 3 * kSplitMixGolden));
    for (uint64_t k = 0; k < 20000; ++k) {
        float const u = samplingUniform(0x1234567ull * k, k);
        if (!(u >= 0.f && u < 1.f)) EXPECT(false);
    }
    EXPECT(float(kUniformMax) < 1.f);
}

PKV_TEST(copy_plan_rows_pitch_width) {
    KVLayout hnd, nhd;
    makeKVLayout(3, 2, 16, 64, PageLayout::kHND, 0, 0, hnd);
    makeKVLayout(3, 2, 16, 64, PageLayout::kNHD, 0, 0, nhd);
    CopyPlan p = copyPlan(hnd, 2, 5);  // HND: a row per (layer, K/V, head) = 12 rows of 16 tokens x 64
    EXPECT_EQ(p.rows, 12);
    EXPECT_EQ(p.pitch, 16 * 64 * 2);
    EXPECT_EQ(p.width, 5 * 64 * 2);
    EXPECT(!p.contiguous());
    p = copyPlan(nhd, 1, 5);  // NHD: a row per (layer, K/V) = 6 rows of 16 tokens x (2 heads x 64)
    EXPECT_EQ(p.rows, 6);
    EXPECT_EQ(p.pitch, 16 * 128);
    EXPECT_EQ(p.width, 5 * 128);
    for (int32_t n : {0, -1, 16}) {  // the whole block: one row
        p = copyPlan(hnd, 2, n);
        EXPECT_EQ(p.rows, 1);
        EXPECT_EQ(p.width, hnd.strideBlock * 2);
        EXPECT(p.contiguous());
    }
    EXPECT_THROW(copyPlan(hnd, 2, 17), KVArgumentError);
}

PKV_TEST(reserve_many_is_all_or_nothing_and_copies_like_sequential_reserves) {
    KVManager m({group()}, {12}, {}, false);
    std::vector<int32_t> prompt = iota(6);
    m.addSequence(1, prompt.data(), 6);
    m.reserve(1, 6);
    m.commit(1, 6);  // pages 0 (full) and 1 (2 of 4 tokens)
    m.fork(1, 2);
    m.fork(1, 3);    // page 1 shared by three
    KVManager sequential = m;
    SeqId ids[] = {2, 3, 1};
    int32_t ones[] = {1, 1, 1};
    m.reserveMany(ids, ones, 3);
    for (SeqId s : ids) sequential.reserve(s, 1);
    EXPECT(m == sequential);  // the first two writers copy page 1, the last writes in place
    EXPECT_EQ(m.copyLog().size(), size_t(2));
    EXPECT_EQ(m.blockList(1, 0)[1], 1);
    KVManager before = m;
    int32_t big[] = {1, 40, 1};  // the second needs more than the pool: nothing may change
    EXPECT_THROW_THEN(m.reserveMany(ids, big, 3), KVCacheExhaustedError, {
        EXPECT(!e.seq.has_value());
        EXPECT(std::string(e.what()).find("reserve_many of 3 sequences") != std::string::npos);
    });
    EXPECT(m == before);
    SeqId twice[] = {2, 2};
    EXPECT_THROW(m.reserveMany(twice, ones, 2), KVArgumentError);
    SeqId unknown[] = {9};
    EXPECT_THROW(m.reserveMany(unknown, ones, 1), UnknownSequenceError);
    m.validate();
}

PKV_TEST(engine_schedules_chunks_then_decodes_and_writes_the_inputs) {
    HostExecutor ex = executor(32, 0, false, /*staticMaxBlocks=*/6);
    EngineConfig cfg = config(4, 10, 4);
    cfg.seed = 9;
    Engine e(ex, cfg);
    e.addRequest(10, iota(9), tokensAtMost(3));  // A: 9 prompt tokens
    e.addRequest(11, iota(3, 20), tokensAtMost(2));  // B: 3
    using S = std::vector<std::pair<RequestId, int32_t>>;
    // Step 1: both admitted, A's first chunk of 4 (the chunk size), B's whole prompt (it samples).
    EXPECT(e.beginStep());
    EXPECT(scheduleOf(e) == (S{{10, 4}, {11, 3}}));
    StepShape const& shape = e.stepShape();
    EXPECT_EQ(shape.numTokens, 7);
    EXPECT_EQ(shape.numRows, 1);
    EXPECT_EQ(shape.tableWidth[0], 6);  // the static width
    StepInputBuffers const& in = ex.buffers();
    EXPECT((std::vector<int64_t>(in.inputIds, in.inputIds + 7) == std::vector<int64_t>{1, 2, 3, 4, 20, 21, 22}));
    EXPECT((std::vector<int32_t>(in.cuQLens, in.cuQLens + 3) == std::vector<int32_t>{0, 4, 7}));
    EXPECT((std::vector<int32_t>(in.pastLens, in.pastLens + 2) == std::vector<int32_t>{0, 0}));
    EXPECT((std::vector<int32_t>(in.blockTables[0], in.blockTables[0] + 12) ==
            std::vector<int32_t>{0, -1, -1, -1, -1, -1, 1, -1, -1, -1, -1, -1}));
    EXPECT_EQ(in.logitsRows[0], 6);  // B's last token
    Request const& b = *e.find(11);
    EXPECT_EQ(in.samplingParams[engine_io::kSamplingUniform], samplingUniform(b.seed, 0));
    EXPECT_EQ(b.seed, deriveSeed(9, 1));  // arrival 1 of an engine seeded 9
    EXPECT_EQ(in.samplingParams[engine_io::kSamplingTopP], 1.f);
    EXPECT_EQ(in.penaltyTokens[0], -1);
    e.endStep(ex.execute(shape));
    EXPECT_EQ(b.output.size(), size_t(1));
    // Step 2: B decodes first, then A's next chunk.
    EXPECT(e.beginStep());
    EXPECT(scheduleOf(e) == (S{{11, 1}, {10, 4}}));
    EXPECT_EQ(ex.buffers().pastLens[0], 3);
    EXPECT_EQ(ex.buffers().inputIds[0], b.output[0]);
    e.endStep(ex.execute(e.stepShape()));  // B done (2 tokens)
    EXPECT(e.find(11) == nullptr);
    // Step 3: A's last prompt token (it samples), step 4: its decode.
    EXPECT(e.beginStep());
    EXPECT(scheduleOf(e) == (S{{10, 1}}));
    EXPECT(e.stepShape().decodeOnly);  // one token, one row: a decode's shape
    e.endStep(ex.execute(e.stepShape()));
    e.step();
    EXPECT(e.scheduledStep().decodes.size() == 1 && e.stepShape().decodeOnly);
    e.run();
    auto done = e.takeFinished();
    EXPECT_EQ(done.size(), size_t(2));
    EXPECT(done[0]->finishReason == FinishReason::kLength && done[1]->output.size() == 3);
    EXPECT_EQ(ex.kv().stats(0).numFree, 32);
}

PKV_TEST(engine_stops_at_eos_stop_tokens_and_length_and_streams) {
    HostExecutor ex = executor(64);
    EngineConfig cfg = config(4, 20, 0);
    // Find what the model says after a prompt, and make it the EOS of a second engine.
    Engine probe(ex, cfg);
    SamplingParams seeded = tokensAtMost(4);
    seeded.seed = 77;
    probe.addRequest(1, iota(5), seeded);
    probe.run();
    std::vector<int32_t> const first = probe.takeFinished()[0]->output;
    cfg.eosTokenIds = {first[1], first[1]};
    Engine e(ex, cfg);
    std::vector<std::pair<RequestId, int32_t>> streamed;
    int32_t finals = 0;
    auto cb = [&](Request const& r, int32_t t, bool finished) {
        streamed.emplace_back(r.id, t);
        finals += finished;
    };
    SamplingParams eos = seeded;
    eos.ignoreEos = false;
    e.addRequest(1, iota(5), eos, cb);  // stops at its second token (EOS kept)
    SamplingParams ignore = eos;
    ignore.ignoreEos = true;
    e.addRequest(2, iota(5), ignore, cb);  // runs to max_new_tokens
    SamplingParams stop = ignore;
    stop.stopTokenIds = {first[2]};
    e.addRequest(3, iota(5), stop, cb);  // stops at its third token
    e.addRequest(4, iota(5), ignore, cb);
    e.step();
    EXPECT(e.abort(4));
    EXPECT(!e.abort(4));
    e.run();
    std::map<RequestId, Request const*> by;
    auto done = e.takeFinished();
    for (auto const& r : done) by[r->id] = r.get();
    EXPECT(by[1]->finishReason == FinishReason::kStop && by[1]->output == std::vector<int32_t>(first.begin(), first.begin() + 2));
    EXPECT(by[2]->finishReason == FinishReason::kLength && by[2]->output == first);
    EXPECT(by[3]->finishReason == FinishReason::kStop && by[3]->output.size() == 3);
    EXPECT(by[4]->finishReason == FinishReason::kAbort && by[4]->output.size() == 1);
    EXPECT_EQ(finals, 4);
    EXPECT_EQ(std::count(streamed.begin(), streamed.end(), std::make_pair(RequestId(4), -1)), 1);
    EXPECT_EQ(streamed.size(), size_t(2 + 4 + 3 + 1 + 1));
    EXPECT_EQ(ex.kv().numSequences(), 0);
}

PKV_TEST(engine_checks_requests_like_python) {
    HostExecutor ex = executor(8);  // 32 tokens of context
    Engine e(ex, config(4, 16, 0));
    EXPECT_EQ(e.maxModelLen(), 32);
    auto message = [&](RequestId id, std::vector<int32_t> prompt, SamplingParams p) -> std::string {
        try {
            e.addRequest(id, std::move(prompt), p);
        } catch (std::invalid_argument const& err) {
            return err.what();
        }
        return "";
    };
    EXPECT_EQ(message(1, {}, {}), "request 1: prompt: it is empty");
    EXPECT_EQ(message(1, {1, kVocab}, {}), "request 1: prompt: token 50 at position 1 is outside the vocabulary [0, 50)");
    SamplingParams p;
    p.maxNewTokens = 30;
    EXPECT_EQ(message(1, iota(3), p), "request 1: prompt of 3 tokens + max_new_tokens 30 exceed the context limit of 32 tokens");
    EXPECT_THROW(e.addRequest(1, iota(3), p), ContextLengthError);
    p.maxNewTokens = std::nullopt;
    e.addRequest(1, iota(3), p);
    EXPECT_EQ(e.find(1)->maxTokens, 29);
    EXPECT_EQ(message(1, iota(3), {}), "request 1: an unfinished request has this id already");
    SamplingParams bad;
    bad.topP = 0;
    EXPECT_EQ(message(2, iota(3), bad), "request 2: top_p: must be > 0 (1 turns it off), got 0");
    bad = {};
    bad.temperature = -1;
    EXPECT_EQ(message(2, iota(3), bad), "request 2: temperature: expected a finite number >= 0, got -1.0");
    bad = {};
    bad.logprobs = 3;
    EXPECT_EQ(message(2, iota(3), bad), "request 2: logprobs: 3 exceeds the 2 top logprobs the graph reports "
                                        "(pagedkv rewrite --top-logprobs)");
    EngineConfig wide = config(4, 16, 0);
    wide.scheduler.maxNumBatchedTokens = 2;
    EXPECT_THROW(Engine(ex, wide), std::invalid_argument);  // fewer tokens than sequences
}

PKV_TEST(engine_penalty_rows_are_distinct_prompt_then_output_tokens) {
    HostExecutor ex = executor(32);
    Engine e(ex, config(4, 16, 0));
    SamplingParams p = tokensAtMost(3);
    p.repetitionPenalty = 1.5;
    e.addRequest(1, {4, 7, 4, 9}, p);
    e.addRequest(2, {3, 3}, tokensAtMost(3));  // no penalties: a -1 row
    EXPECT(e.beginStep());
    StepInputBuffers const& in = ex.buffers();
    EXPECT_EQ(e.stepShape().penaltyWidth, 3);
    EXPECT((std::vector<int32_t>(in.penaltyTokens, in.penaltyTokens + 6) == std::vector<int32_t>{4, 7, 9, -1, -1, -1}));
    EXPECT_EQ(in.samplingParams[engine_io::kSamplingRepetitionPenalty], 1.5f);
    e.endStep(ex.execute(e.stepShape()));
    int32_t const t = e.find(1)->output[0];
    EXPECT(e.beginStep());
    std::vector<int32_t> row(ex.buffers().penaltyTokens, ex.buffers().penaltyTokens + e.stepShape().penaltyWidth);
    std::vector<float> counts(ex.buffers().penaltyCounts, ex.buffers().penaltyCounts + e.stepShape().penaltyWidth);
    auto at = std::find(row.begin(), row.end(), t) - row.begin();
    EXPECT(at < int64_t(row.size()) && counts[at] == 1.f);
    EXPECT_EQ(counts[0], t == 4 ? 1.f : 0.f);  // prompt tokens count only their output occurrences
    e.cancelStep();
    EXPECT_EQ(ex.kv().reserved(1), 0);
}

PKV_TEST(batched_preempted_and_swapped_requests_get_the_tokens_they_get_alone) {
    std::map<RequestId, std::vector<int32_t>> prompts;
    for (RequestId id = 0; id < 9; ++id) prompts[id] = iota(3 + int32_t(id) * 3, int32_t(id) * 5);
    std::map<RequestId, std::vector<int32_t>> alone;
    for (auto const& [id, prompt] : prompts) {
        HostExecutor ex = executor(64);
        alone[id] = runAll(ex, config(1, 64, 0), {{id, prompt}}, 12)[id];
    }
    SchedulerStats stats;
    HostExecutor tight = executor(14, 0, /*prefix=*/true);  // 56 tokens for 9 requests of up to 39 tokens
    EXPECT(runAll(tight, config(6, 12, 5), prompts, 12, &stats) == alone);
    EXPECT(stats.preemptions > 0);
    HostExecutor swap = executor(14, 8);
    EXPECT(runAll(swap, config(6, 12, 5, Preemption::kSwap), prompts, 12, &stats) == alone);
    EXPECT(stats.swapsOut > 0 && stats.swapsIn > 0);
    EXPECT_EQ(swap.kv().stats(0).hostFree, 8);
}

}  // namespace pagedkv::runtime::check
