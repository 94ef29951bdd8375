// Entry points of pagedkv_runtime_check's subcommands (main.cpp dispatches).
#pragma once

#include <cstdint>

namespace pagedkv::runtime::check {

// The stateful random test: at least `operations` operations over episodes of `stepsPerEpisode`, cycling
// through the configurations. Returns the process exit status; prints "N passed, N failed".
int runRandom(int64_t operations, uint64_t seed, int32_t stepsPerEpisode);

struct BenchOptions {
    int32_t seqs = 256;
    int32_t context = 4096;  // cached tokens per sequence
    int32_t pageSize = 16;
    int32_t steps = 200;  // timed decode steps
    bool prefixReuse = false;
};
// Host time per decode step: reserve + commit of every sequence and the step metadata into a staging buffer.
int runBench(BenchOptions const& options);
// Host time per decode step of the engine: scheduler, step inputs, commit, tokens, stops.
int runEngineBench(BenchOptions const& options);

}  // namespace pagedkv::runtime::check
