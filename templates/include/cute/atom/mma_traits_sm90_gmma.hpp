// pagedattn: stands in for CUTLASS's <cute/atom/mma_traits_sm90_gmma.hpp>, which <cute/atom/mma_atom.hpp>
// includes whatever the kernel; the warpgroup-MMA kernels (PAGEDATTN_WGMMA, attn_wgmma.cuh) take CUTLASS's,
// the others do not use it (pagedattn/cute_trim.cuh: why, and what it saves).
#pragma once
#if PAGEDATTN_WGMMA || PAGEDATTN_FULL_CUTE
#include_next <cute/atom/mma_traits_sm90_gmma.hpp>
#endif
