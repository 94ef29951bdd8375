// The Hopper multi-token kernel's instances at head dim 96 (attention_multi_sm90.cuh): a translation unit per head dim.
#include "attention_multi_sm90.cuh"

PKV_SM90_INSTANCES(96)
