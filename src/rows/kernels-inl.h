// The row schemes' attention kernel traits, and the one list the fused
// kernel (attention.cc) dispatches on. A scheme's traits (in its family's
// <family>_rows-inl.h) are a struct with
//   kId          its KvScheme
//   kTile        the tile code format of its K / V tiles (row_scheme.h), or kNone
//   kRowScales   whether its rows carry f32 scales in their header
//   kFold        a constant folded into every score and weight (fp8 on F16C)
//   RowScale(header, head)     the row's scale for a KV head (header null
//                              without kRowScales)
//   Load(d, row, x)            payload elements [x, x + Lanes(d)) as floats,
//                              before the row scale
//   LoadBlock(d, block, v)     block schemes only (kQ8, kQ4): a ggml block
//   kBlockBytes                block schemes only
// The tile paths read the codes by kTile (a layout shared by schemes), not
// by scheme.

// Per-target include guard (Highway idiom).
#if defined(KVQ_SRC_SCHEMES_KERNELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVQ_SRC_SCHEMES_KERNELS_INL_H_
#undef KVQ_SRC_SCHEMES_KERNELS_INL_H_
#else
#define KVQ_SRC_SCHEMES_KERNELS_INL_H_
#endif

#include "src/rows/float_rows-inl.h"
#include "src/rows/fp8_rows-inl.h"
#include "src/rows/ggml_rows-inl.h"
#include "src/rows/int8_rows-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {

template <class... S>
struct RowKernelList {};

// Every row scheme's kernel traits (the same schemes as registry.cc).
using RowKernels = RowKernelList<Fp32Kernel, Fp16Kernel, Bf16Kernel, Int8Kernel, Int8HeadKernel, Fp8E4M3Kernel,
                                 Fp8E4M3ScaledKernel, Fp8E5M2Kernel, Q8_0Kernel, Q4_0Kernel>;

}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
