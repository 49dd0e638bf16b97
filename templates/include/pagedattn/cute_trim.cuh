// CuTe headers that pagedattn kernels leave out, and how.
//
// <cute/atom/mma_atom.hpp> and <cute/atom/copy_atom.hpp> (so <cute/tensor.hpp> too) end by including the
// MMA and copy traits of every architecture. Parsing those is most of CuTe's cost under NVRTC: on the
// 2-core build machine an include-only program with <cute/tensor.hpp> (sm_90a, libcu++ unroll limit 10,
// nvrtc_compat.cuh) spent ~1.2 s in the front end and peaked at 350 MB; without the headers below
// ~0.55 s and 216 MB (~0.8 s and 263 MB when the warpgroup-MMA traits stay in).
//
// NVRTC searches pagedattn's include root (templates/include) before CUTLASS's, so the files of the same
// names under templates/include/cute/atom/ are found first and stand in for CUTLASS's:
//   mma_traits_sm90.hpp          fp64/complex mma.sync (and through it the sm_90 wgmma arch headers)
//   mma_traits_sm90_gmma.hpp     wgmma traits: CUTLASS's when PAGEDATTN_WGMMA (attn_wgmma.cuh) is set
//   mma_traits_sm100.hpp         UMMA, tensor memory, and the sparse wgmma traits it includes
//   mma_traits_sm120.hpp, mma_traits_sm120_sparse.hpp
//   copy_traits_sm100.hpp, copy_traits_sm100_tma.hpp
// A kernel that needs one of them fails to compile (an incomplete MMA_Traits/Copy_Traits or an unknown
// name), never picks something else. -DPAGEDATTN_FULL_CUTE=1 takes all of CUTLASS's again (A/B checks).
//
// The quoted includes below change nothing in the compiled program (CuTe has included these files by now,
// and each is #pragma once); they make the stand-ins part of the kernels' cache keys (headers_digest).
#pragma once

#include "cute/atom/mma_traits_sm90.hpp"
#include "cute/atom/mma_traits_sm90_gmma.hpp"
#include "cute/atom/mma_traits_sm100.hpp"
#include "cute/atom/mma_traits_sm120.hpp"
#include "cute/atom/mma_traits_sm120_sparse.hpp"
#include "cute/atom/copy_traits_sm100.hpp"
#include "cute/atom/copy_traits_sm100_tma.hpp"
