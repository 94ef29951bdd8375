// `run-engine` mode (needs a GPU): the C++ runtime's Engine (scheduler, KV manager, step builder) over the
// plugins-only executor (pluginsExecutor.h: the runtime's device pools, staged upload and CUDA graphs, the two
// plugins through IPluginV3), for a request trace; tests/gpu/test_runtime_executor.py checks every step.
//
// Plan (JSON):
//   {"model": {"layers": 2, "vocab": 101, "qkv_width": 512, "max_position": 256, "io_type": "kHALF",
//              "token_rows": "tok.bin", "position_rows": "pos.bin",      float32 [L, vocab | max_position, W]
//              "write_attrs": [{...}, ...], "attention_attrs": [{...}, ...]},   per layer, as ONNX attributes
//    "group": {"num_layers": 2, "num_kv_heads": 2, "page_size": 16, "head_dim": 64, "page_layout": 0,
//              "cache_dtype": 0},
//    "num_blocks": 48, "host_blocks": 0, "prefix_reuse": true, "cuda_graphs": true,
//    "limits": {"max_tokens": 32, "max_seqs": 4, "max_blocks": 16},
//    "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 32, "chunk_size": 16, "preemption": "recompute"},
//    "requests": [{"id": 1, "arrival": 0, "prompt": [...], "max_new_tokens": 7}, ...],   arrival: a step index
//    "max_steps": 200}
// Writes <out>/step<N>/{input_ids,cu_q_lens,past_lens,block_table,q<l>,out<l>}.bin (the step's real rows) and
// returns {"ok", "steps": [{"step", "request_ids", "num_decodes", "decode_only", "enqueues", "num_tokens",
// "table_width"}], "requests": {"<id>": {"output": [...], "finish_reason"}}, "graphs", "graphs_off", "stats",
// "kv"}; "error" names what failed (exit 1).
#pragma once

#include <string>

#include "json.h"
#include "pluginLibrary.h"

namespace testhost {

Json runEngine(PluginLibrary& library, Json const& plan, std::string const& planDir, std::string const& outDir);

}  // namespace testhost
