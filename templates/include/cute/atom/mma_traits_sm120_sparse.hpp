// pagedattn: stands in for CUTLASS's <cute/atom/mma_traits_sm120_sparse.hpp>, which <cute/atom/mma_atom.hpp> includes
// whatever the kernel; no pagedattn kernel uses it (pagedattn/cute_trim.cuh: why, and what it saves).
#pragma once
#if PAGEDATTN_FULL_CUTE
#include_next <cute/atom/mma_traits_sm120_sparse.hpp>
#endif
