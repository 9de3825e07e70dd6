/// \file kvc_cuda.cuh
/// Umbrella header of kvc::cuda: the device cache, the fused decode attention and the dense linear
/// algebra backend (cuBLAS / cuSOLVER), and QAQ's mixed-bit device cache with its attention. Include from .cu
/// files compiled by nvcc.
#pragma once

#include <kvc/cuda/aligned/decode_attention.cuh>
#include <kvc/cuda/decode_attention.cuh>
#include <kvc/cuda/device_kv_cache.cuh>
#include <kvc/cuda/linalg.cuh>
#include <kvc/cuda/qaq/decode_attention.cuh>
#include <kvc/cuda/qaq/device_qaq_cache.cuh>
