// Grouped block-FP8 GEMM for Hopper: routed experts at prefill sizes, on CUTLASS's pointer-array kernel with
// blockwise scaling (a TMA producer warp, two consumer warpgroups that scale one K block's partial sums while the
// next block's MMAs run). pdserve.ops.cutlass_fp8 compiles this file with nvcc on first use and calls it by ctypes.
//
// Inputs, as pdserve lays them out (rows sorted by expert, `group_ends` the cumulative row ends, on the device):
//   a        [rows, K] e4m3, row-major                  a_scales  [K/128, scale_rows] float: one per row per K block
//   b        [groups, N, K] e4m3 (each expert N x K)    b_scales  [groups, N/128, K/128] float (the checkpoint's grid)
//   d        [rows, N] bf16, row-major
// Every pointer array, stride and per-group problem size is written on the device from `group_ends`, so a call
// never waits for the GPU and can be captured in a CUDA graph. CUTLASS reads each group's activation scales as a
// compact [K/128, m_g] block and the weight scales with N blocks contiguous, so both are re-laid into the workspace
// first.

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

namespace pdserve_grouped_fp8 {

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;  // [N, K] with K contiguous, read as a K x N column-major matrix
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignmentA = 16;
constexpr int kAlignmentB = 16;
constexpr int kAlignmentD = 8;
constexpr int kScaleBlock = 128;

// Swept on an H100 at V3's EP8 expert shapes (4k and 16k rows): 128 x 128 tiles over two consumer warpgroups with
// clusters of two along N beat clusters of one or along M (by up to 17%), ping-pong schedules (64 x 128 tiles: up to
// 1.5x slower, 128 x 128: 2.4-2.9x) and 128 x 256 tiles (2.2-3.6x slower). The tile scheduler's default (raster along
// M, no swizzle) beat raster along N and swizzles of 2-8 at 16k rows by 4-77%; swizzles gained up to 7% at 4k rows.
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _2, _1>;
using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutD*, kAlignmentD, ElementD, LayoutD*, kAlignmentD,
    EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float, void>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignmentA,
    ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignmentB,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideC = typename GemmKernel::InternalStrideC;
using StrideD = typename GemmKernel::InternalStrideD;
using GroupShape = typename ProblemShape::UnderlyingProblemShape;

// The per-group arrays CUTLASS reads, carved from the caller's workspace.
struct GroupArrays {
  GroupShape* shapes;
  const ElementA** a;
  const ElementB** b;
  ElementD** d;
  const float** sfa;
  const float** sfb;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideC* stride_c;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  float* sfa_compact;  // [rows * K/128]: group g's scales at group_start * K/128, as [K/128, m_g]
  float* sfb_mn_major;  // [groups, K/128, N/128]
};

size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Carves the arrays from `base` (nullptr: only counts); returns the bytes they take.
size_t carve(char* base, int groups, int rows, int n_blocks, int k_blocks, GroupArrays* out) {
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    char* at = base ? base + offset : nullptr;
    offset += align_up(bytes);
    return at;
  };
  GroupArrays arrays;
  arrays.shapes = reinterpret_cast<GroupShape*>(take(sizeof(GroupShape) * groups));
  arrays.a = reinterpret_cast<const ElementA**>(take(sizeof(void*) * groups));
  arrays.b = reinterpret_cast<const ElementB**>(take(sizeof(void*) * groups));
  arrays.d = reinterpret_cast<ElementD**>(take(sizeof(void*) * groups));
  arrays.sfa = reinterpret_cast<const float**>(take(sizeof(void*) * groups));
  arrays.sfb = reinterpret_cast<const float**>(take(sizeof(void*) * groups));
  arrays.stride_a = reinterpret_cast<StrideA*>(take(sizeof(StrideA) * groups));
  arrays.stride_b = reinterpret_cast<StrideB*>(take(sizeof(StrideB) * groups));
  arrays.stride_c = reinterpret_cast<StrideC*>(take(sizeof(StrideC) * groups));
  arrays.stride_d = reinterpret_cast<StrideD*>(take(sizeof(StrideD) * groups));
  arrays.layout_sfa = reinterpret_cast<LayoutSFA*>(take(sizeof(LayoutSFA) * groups));
  arrays.layout_sfb = reinterpret_cast<LayoutSFB*>(take(sizeof(LayoutSFB) * groups));
  arrays.sfa_compact = reinterpret_cast<float*>(take(sizeof(float) * static_cast<size_t>(rows) * k_blocks));
  arrays.sfb_mn_major = reinterpret_cast<float*>(take(sizeof(float) * static_cast<size_t>(groups) * n_blocks * k_blocks));
  if (out) *out = arrays;
  return offset;
}

__global__ void fill_group_arrays(GroupArrays arrays, const int* group_ends, int groups, int n, int k,
                                  const ElementA* a, const ElementB* b, ElementD* d) {
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  int start = g ? group_ends[g - 1] : 0;
  int m = group_ends[g] - start;
  int k_blocks = k / kScaleBlock;
  arrays.shapes[g] = GroupShape{m, n, k};
  arrays.a[g] = a + static_cast<int64_t>(start) * k;
  arrays.b[g] = b + static_cast<int64_t>(g) * n * k;
  arrays.d[g] = d + static_cast<int64_t>(start) * n;
  arrays.sfa[g] = arrays.sfa_compact + static_cast<int64_t>(start) * k_blocks;
  arrays.sfb[g] = arrays.sfb_mn_major + static_cast<int64_t>(g) * k_blocks * (n / kScaleBlock);
  arrays.stride_a[g] = cutlass::make_cute_packed_stride(StrideA{}, {m, k, 1});
  arrays.stride_b[g] = cutlass::make_cute_packed_stride(StrideB{}, {n, k, 1});
  arrays.stride_c[g] = cutlass::make_cute_packed_stride(StrideC{}, {m, n, 1});
  arrays.stride_d[g] = cutlass::make_cute_packed_stride(StrideD{}, {m, n, 1});
  arrays.layout_sfa[g] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
  arrays.layout_sfb[g] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
}

// One thread per (row, K block): a_scales[kb][row] -> group-compact [kb][row - start] at start * k_blocks.
__global__ void compact_row_scales(const float* a_scales, int scale_rows, const int* group_ends, int groups, int rows,
                                   int k_blocks, float* compact) {
  int row = blockIdx.x * blockDim.x + threadIdx.x;
  int kb = blockIdx.y;
  // Rows past the last group (slots of other ranks' experts) have no scales to keep: as the last group's they would
  // land on its next K block's.
  if (row >= rows || row >= group_ends[groups - 1]) return;
  int lo = 0, hi = groups - 1;  // the first group whose end is past this row
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (group_ends[mid] > row) hi = mid; else lo = mid + 1;
  }
  int start = lo ? group_ends[lo - 1] : 0;
  int m = group_ends[lo] - start;
  compact[static_cast<int64_t>(start) * k_blocks + static_cast<int64_t>(kb) * m + (row - start)] =
      a_scales[static_cast<int64_t>(kb) * scale_rows + row];
}

// One thread per weight scale: [g][nb][kb] -> [g][kb][nb].
__global__ void transpose_weight_scales(const float* b_scales, int count, int n_blocks, int k_blocks, float* out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  int kb = i % k_blocks;
  int nb = (i / k_blocks) % n_blocks;
  int g = i / (k_blocks * n_blocks);
  out[(static_cast<int64_t>(g) * k_blocks + kb) * n_blocks + nb] = b_scales[i];
}

typename Gemm::Arguments make_arguments(const GroupArrays& arrays, int groups, int device, int sm_count) {
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = sm_count;
  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, arrays.shapes, nullptr},
      {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b, arrays.sfa, arrays.layout_sfa, arrays.sfb,
       arrays.layout_sfb},
      {{}, nullptr, arrays.stride_c, arrays.d, arrays.stride_d},
      hw_info};
  auto& fusion = arguments.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  return arguments;
}

}  // namespace pdserve_grouped_fp8

using namespace pdserve_grouped_fp8;

extern "C" {

// Bytes of workspace one call needs: the group arrays, the compact scales and CUTLASS's own.
size_t pdserve_grouped_fp8_gemm_workspace(int groups, int rows, int n, int k, int device, int sm_count) {
  GroupArrays arrays{};
  size_t own = carve(nullptr, groups, rows, n / kScaleBlock, k / kScaleBlock, &arrays);
  return own + align_up(Gemm::get_workspace_size(make_arguments(arrays, groups, device, sm_count)));
}

// 0 on success; otherwise a cutlass::Status or a CUDA error code (negated).
int pdserve_grouped_fp8_gemm(const void* a, const float* a_scales, int scale_rows, const void* b,
                             const float* b_scales, const int* group_ends, void* d, int groups, int rows, int n,
                             int k, void* workspace, size_t workspace_bytes, int device, int sm_count,
                             cudaStream_t stream) {
  if (k % kScaleBlock || n % kScaleBlock) return static_cast<int>(cutlass::Status::kErrorInvalidProblem);
  int k_blocks = k / kScaleBlock, n_blocks = n / kScaleBlock;
  GroupArrays arrays;
  size_t own = carve(static_cast<char*>(workspace), groups, rows, n_blocks, k_blocks, &arrays);
  fill_group_arrays<<<(groups + 127) / 128, 128, 0, stream>>>(
      arrays, group_ends, groups, n, k, static_cast<const ElementA*>(a), static_cast<const ElementB*>(b),
      static_cast<ElementD*>(d));
  int weight_scales = groups * n_blocks * k_blocks;
  transpose_weight_scales<<<(weight_scales + 255) / 256, 256, 0, stream>>>(b_scales, weight_scales, n_blocks,
                                                                           k_blocks, arrays.sfb_mn_major);
  if (rows > 0) {
    compact_row_scales<<<dim3((rows + 255) / 256, k_blocks), 256, 0, stream>>>(
        a_scales, scale_rows, group_ends, groups, rows, k_blocks, arrays.sfa_compact);
  }
  cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) return -static_cast<int>(launched);
  auto arguments = make_arguments(arrays, groups, device, sm_count);
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(arguments);
  if (status != cutlass::Status::kSuccess) return static_cast<int>(status);
  if (own + Gemm::get_workspace_size(arguments) > workspace_bytes) {
    return static_cast<int>(cutlass::Status::kErrorWorkspaceNull);
  }
  status = gemm.initialize(arguments, static_cast<char*>(workspace) + own, stream);
  if (status != cutlass::Status::kSuccess) return static_cast<int>(status);
  status = gemm.run(stream);
  return static_cast<int>(status);
}

}  // extern "C"
