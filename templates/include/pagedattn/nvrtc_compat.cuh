// The few shims NVRTC needs, in one place. Everything else includes this first.
#pragma once

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
