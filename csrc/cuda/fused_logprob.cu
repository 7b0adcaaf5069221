// Fused linear log-prob + entropy, CUDA block kernels (moerl issue #15).
//
// The op's block loop is the one of csrc/cpu/fused_logprob.cpp: the [rows, cols] logits block
// x = h_blk @ W_blk^T is produced by cuBLAS (at::mm_out in csrc/cuda/ops_cuda.cpp); these kernels do the
// per-row work on it:
//   moerl_lse_block:      fold the block into per-token online log-sum-exp statistics
//                         stats[t] = (m, s = sum exp(x/T - m), u = sum exp(x/T - m) x/T, label logit)
//                         (Milakov & Gimelshein 2018, arXiv 1805.02867); one thread block per row.
//   moerl_softmax_grad_block: overwrite the block with d logits =
//                         (g_lp (1[k = label] - p_k) - g_ent p_k (x_k/T - mean)) / T, p_k = exp(x_k/T - lse).
// Plain CUDA (no torch headers) so that `nvcc -c` checks it quickly; host launchers are extern "C".
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// block-wide reduction of one float (op: 0 = max, 1 = sum); every thread gets the result
template <int Op>
__device__ float block_reduce(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = Op == 0 ? warp_max(v) : warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  float r = threadIdx.x < nwarps ? shared[threadIdx.x] : (Op == 0 ? -INFINITY : 0.f);
  if (warp == 0) r = Op == 0 ? warp_max(r) : warp_sum(r);
  if (threadIdx.x == 0) shared[0] = r;
  __syncthreads();
  return shared[0];
}

__global__ void lse_block_kernel(const float* __restrict__ x, int64_t cols, int64_t ld, float inv_t,
                                 const int64_t* __restrict__ labels, int64_t col_offset, float* __restrict__ stats) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * ld;
  float mc = -INFINITY;
  for (int64_t k = threadIdx.x; k < cols; k += blockDim.x) mc = fmaxf(mc, xr[k] * inv_t);
  mc = block_reduce<0>(mc, shared);
  float* st = stats + 4 * row;
  const float m_old = st[0];
  const float m_new = fmaxf(m_old, mc);
  float se = 0.f, sx = 0.f;
  for (int64_t k = threadIdx.x; k < cols; k += blockDim.x) {
    const float xs = xr[k] * inv_t;
    const float e = __expf(xs - m_new);
    se += e;
    sx += e * xs;
  }
  se = block_reduce<1>(se, shared);
  sx = block_reduce<1>(sx, shared);
  if (threadIdx.x == 0) {
    const float rescale = st[1] > 0.f ? __expf(m_old - m_new) : 0.f;
    st[0] = m_new;
    st[1] = st[1] * rescale + se;
    st[2] = st[2] * rescale + sx;
    const int64_t local = labels[row] - col_offset;
    if (local >= 0 && local < cols) st[3] = xr[local] * inv_t;
  }
}

__global__ void softmax_grad_block_kernel(float* __restrict__ x, int64_t cols, int64_t ld, float inv_t,
                                          const int64_t* __restrict__ labels, int64_t col_offset,
                                          const float* __restrict__ lse, const float* __restrict__ mean,
                                          const float* __restrict__ g_lp, const float* __restrict__ g_ent) {
  const int64_t row = blockIdx.x;
  float* xr = x + row * ld;
  const float l = lse[row], mu = mean[row], a = g_lp[row], g = g_ent[row];
  const int64_t local = labels[row] - col_offset;
  for (int64_t k = threadIdx.x; k < cols; k += blockDim.x) {
    const float xs = xr[k] * inv_t;
    const float p = __expf(xs - l);
    float d = -p * (a + g * (xs - mu));
    if (k == local) d += a;
    xr[k] = d * inv_t;
  }
}

}  // namespace

extern "C" {

// stats [rows, 4] float32 (row-major), x [rows, cols] with row stride ld, labels [rows] int64 (global ids),
// col_offset = global id of the block's first column.
cudaError_t moerl_lse_block(const float* x, int64_t rows, int64_t cols, int64_t ld, float inv_t,
                            const int64_t* labels, int64_t col_offset, float* stats, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  lse_block_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, cols, ld, inv_t, labels, col_offset, stats);
  return cudaGetLastError();
}

cudaError_t moerl_softmax_grad_block(float* x, int64_t rows, int64_t cols, int64_t ld, float inv_t,
                                     const int64_t* labels, int64_t col_offset, const float* lse, const float* mean,
                                     const float* g_lp, const float* g_ent, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  softmax_grad_block_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, cols, ld, inv_t, labels, col_offset,
                                                                                  lse, mean, g_lp, g_ent);
  return cudaGetLastError();
}

}  // extern "C"
