// Host time of one decode step of the C++ engine: what issue #16 sets a goal for (scheduler + step metadata
// <= 50 us at 256 running sequences), measured the way benchmarks/bench_runtime.py measures the Python engine.
// Per step: the scheduler (the decodes, reserveMany of their KV slots), the step's engine inputs written where
// the executor wants them (block table, cu_q_lens, past_lens, input ids, logits rows, each request's sampling
// row with its SplitMix64 draw, penalty rows), then commit, the tokens and the stop checks. The device is a
// HostExecutor whose function answers a token per row (its time is the engine's `execute`, reported apart).
// Each sequence holds `context` cached tokens (prefilled through the engine first); page-boundary crossings
// and allocation happen inside the timed steps.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "commands.h"
#include "pagedkv/runtime/engine.h"

namespace pagedkv::runtime::check {

namespace {

double percentile(std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[std::min(v.size() - 1, size_t(q * double(v.size())))];
}

}  // namespace

int runEngineBench(BenchOptions const& o) {
    PoolGroupParams p;  // llama3-8b's KV geometry and vocabulary (the host cost barely depends on them)
    p.name = "llama3-8b";
    p.numLayers = 32;
    p.numKVHeads = 8;
    p.headDim = 128;
    p.pageSize = o.pageSize;
    ModelInfo model;
    model.vocab = 128256;
    model.numTopLogprobs = 1;
    int32_t const warmup = 5;
    int64_t const pages = (o.context + o.steps + warmup + 1 + o.pageSize - 1) / o.pageSize + 1;
    auto answer = [](HostStep const& step, std::vector<int32_t>& tokens, std::vector<float>&, std::vector<int32_t>&,
                     std::vector<float>&) {
        for (int32_t r = 0; r < step.shape.numRows; ++r)
            tokens[r] = int32_t((step.inputs.inputIds[step.inputs.logitsRows[r]] * 7 + 1) % 1000);
    };
    HostExecutor ex(KVManager({makePoolGroup(p)}, {int64_t(double(o.seqs * pages) * 1.05) + 16}, {}, o.prefixReuse),
                    model, answer);
    EngineConfig cfg;
    cfg.scheduler.maxNumSeqs = o.seqs;
    cfg.scheduler.maxNumBatchedTokens = std::max(o.seqs, 16384);
    cfg.scheduler.chunkSize = 0;
    cfg.eosTokenIds = {model.vocab - 1};
    Engine engine(ex, cfg);
    SamplingParams params;
    params.maxNewTokens = o.steps + 2 * o.seqs + warmup;
    params.temperature = 0.8;
    params.topP = 0.95;
    std::vector<int32_t> prompt(o.context);
    for (int32_t s = 0; s < o.seqs; ++s) {
        for (int32_t i = 0; i < o.context; ++i) prompt[i] = 1 + (s * 7919 + i * 31) % 32000;  // distinct prompts
        engine.addRequest(s, prompt, params);
    }
    while (engine.scheduler().running().size() < size_t(o.seqs) || !engine.scheduledStep().prefills.empty())
        engine.step();  // the prefills
    for (int32_t i = 0; i < warmup; ++i) engine.step();
    std::vector<double> schedule, prepare, finish, host, stand;
    for (int32_t i = 0; i < o.steps; ++i) {
        engine.step();
        StepTiming const& t = engine.timing();
        if (engine.stepShape().numSeqs != o.seqs || !engine.stepShape().decodeOnly) {
            std::fprintf(stderr, "bench-engine: step %d ran %d sequences, expected %d decodes\n", i,
                         engine.stepShape().numSeqs, o.seqs);
            return 1;
        }
        schedule.push_back(t.schedule * 1e6);
        prepare.push_back(t.prepare * 1e6);
        finish.push_back(t.finish * 1e6);
        host.push_back(t.host() * 1e6);
        stand.push_back(t.execute * 1e6);
    }
    ex.kv().validate();
    std::printf("# C++ engine, decode: %d sequences x %d cached tokens, page %d, prefix reuse %s; medians of %d steps\n",
                o.seqs, o.context, o.pageSize, o.prefixReuse ? "on" : "off", o.steps);
    std::printf("schedule         median %8.1f us   (decodes, reserveMany)\n", percentile(schedule, 0.5));
    std::printf("prepare          median %8.1f us   (step metadata, input ids, logits rows, sampling rows)\n",
                percentile(prepare, 0.5));
    std::printf("finish           median %8.1f us   (commit, tokens, stops)\n", percentile(finish, 0.5));
    std::printf("engine host      median %8.1f us   p90 %8.1f us   (goal 50 us)\n", percentile(host, 0.5),
                percentile(host, 0.9));
    std::printf("stand-in device  median %8.1f us   (the HostExecutor's function: not host overhead)\n",
                percentile(stand, 0.5));
    std::printf("# reproduce: pagedkv_runtime_check bench-engine --seqs %d --context %d --page-size %d --steps %d%s\n",
                o.seqs, o.context, o.pageSize, o.steps, o.prefixReuse ? " --prefix 1" : "");
    return 0;
}

}  // namespace pagedkv::runtime::check
