// The reason behind a launcher's last failure (launchQKVWrite, launchAttention, computeRopeParams): one
// "field=value: expected ..." line for invalid parameters, or the failing CUDA call's name for a CUDA error.
// Thread-local; each launch clears it first, so it never reports an earlier call's failure.
#pragma once

namespace pagedkv {

char const* lastErrorMessage();

}  // namespace pagedkv
