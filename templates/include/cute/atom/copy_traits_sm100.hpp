// pagedattn: stands in for CUTLASS's <cute/atom/copy_traits_sm100.hpp>, which <cute/atom/copy_atom.hpp> includes
// whatever the kernel; no pagedattn kernel uses it (pagedattn/cute_trim.cuh: why, and what it saves).
#pragma once
#if PAGEDATTN_FULL_CUTE
#include_next <cute/atom/copy_traits_sm100.hpp>
#endif
