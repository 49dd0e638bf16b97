// The few shims NVRTC needs, in one place. Everything else includes this first.
#pragma once

// libcu++ (cuda/std/__type_traits/type_list.h) writes out __type_index for the first
// _CCCL_META_UNROLL_LIMIT indices with nested _CCCL_PP_REPEAT macros; the default is 10 under NVCC and
// 16 under NVRTC, and at 16 the expansion alone costs NVRTC's front end ~0.6-0.7 s of every program that
// includes <cuda/std/type_traits> (CuTe does), against ~0.05 s at 10. Larger indices take the generic
// path, so only compile time changes. Must come before the first libcu++ include.
#ifndef _CCCL_META_UNROLL_LIMIT
#define _CCCL_META_UNROLL_LIMIT 10
#endif

#include <cuda/std/cstdint>
#include <cuda/std/cstddef>

#ifdef __CUDACC_RTC__
using cuda::std::int32_t;
using cuda::std::int64_t;
using cuda::std::uint8_t;
using cuda::std::uint16_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::uintptr_t;
#endif
