/// \file kvc_cuda.cuh
/// Umbrella header of kvc::cuda: the device cache, the fused decode attention and the dense linear
/// algebra backend (cuBLAS / cuSOLVER). Include from .cu files compiled by nvcc.
#pragma once

#include <kvc/cuda/decode_attention.cuh>
#include <kvc/cuda/device_kv_cache.cuh>
#include <kvc/cuda/linalg.cuh>
