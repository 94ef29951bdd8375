// `enqueue` mode (needs a GPU): runs plugin steps on real device buffers exactly as an engine would —
// createPlugin (build) -> output types/shapes -> supportsFormatCombination -> configurePlugin ->
// getWorkspaceSize -> getFieldsToSerialize -> createPlugin (runtime) -> attachToContext -> onShapeChange ->
// enqueue — and dumps the requested tensors and buffers for the Python tests to compare with the references.
//
// Plan (JSON):
//   {"buffers": {"pool0": {"file": "pool0.bin"}},                  device allocations not seen as tensors
//    "tensors": {"qkv": {"type": "kHALF", "dims": [7, 384], "file": "qkv.bin"},
//                "kv_pools": {"type": "kINT64", "dims": [1, 4], "file": "kv_pools.bin",
//                             "addresses": [{"element": 0, "buffer": "pool0", "offset": 4096}]}, ...},
//                                                              element 0 := device address of pool0 + 4096 bytes
//    "steps": [{"plugin": "PagedKVQKVWrite", "attrs": {...}, "inputs": ["qkv", ...], "outputs": ["q", "status"],
//               "poison_byte": 255,                             outputs and workspace start filled with it
//               "enqueue_phase": "build"}, ...],                enqueue the build-phase instance (tactic timing)
//    "dump": ["q", "status", "pool0"]}
// Writes <out>/<name>.bin and <out>/manifest.json; returns the step report.
#pragma once

#include <string>

#include "json.h"
#include "pluginLibrary.h"

namespace testhost {

Json runEnqueue(PluginLibrary& library, Json const& plan, std::string const& planDir, std::string const& outDir);

}  // namespace testhost
