// Blockwise FP8 (E4M3) quantise / dequantise, CUDA (moerl issue #15); the scheme and the bitwise
// contract of csrc/cpu/fp8_quant.cpp and moerl/precision/fp8.py. The [gr, gc] amax grid is reduced here,
// the scales are formed from it by the binding (csrc/cuda/ops_cuda.cpp) with the reference's own ATen ops,
// then each element is q = e4m3_rne(clamp(x / s, -448, 448)) (cuda_fp8.h's __nv_cvt_float_to_fp8,
// round-to-nearest-even as torch's cast) and dequantised as float(q) * s.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

__global__ void block_amax_kernel(const float* __restrict__ x, int64_t r, int64_t k, int64_t br, int64_t bk, int64_t gk,
                                  float* __restrict__ amax) {
  __shared__ float shared[256];
  const int64_t g = blockIdx.x / gk, c = blockIdx.x % gk;
  const int64_t r0 = g * br, r1 = min(r, r0 + br), c0 = c * bk, c1 = min(k, c0 + bk);
  const int64_t width = c1 - c0, n = (r1 - r0) * width;
  float m = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, fabsf(x[(r0 + i / width) * k + c0 + i % width]));
  shared[threadIdx.x] = m;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) amax[blockIdx.x] = shared[0];
}

__global__ void quantize_kernel(const float* __restrict__ x, int64_t r, int64_t k, int64_t br, int64_t bk, int64_t gk,
                                const float* __restrict__ scales, __nv_fp8_storage_t* __restrict__ q) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= r * k) return;
  const int64_t row = i / k, col = i % k;
  float v = x[i] / scales[(row / br) * gk + col / bk];
  v = fminf(fmaxf(v, -448.f), 448.f);
  q[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

__global__ void dequantize_kernel(const __nv_fp8_storage_t* __restrict__ q, int64_t r, int64_t k, int64_t br, int64_t bk,
                                  int64_t gk, const float* __restrict__ scales, float* __restrict__ out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= r * k) return;
  const int64_t row = i / k, col = i % k;
  const __half_raw h = __nv_cvt_fp8_to_halfraw(q[i], __NV_E4M3);
  out[i] = __half2float(__half(h)) * scales[(row / br) * gk + col / bk];
}

// one thread per element of an [r, k] matrix
template <class Kernel, class... Args>
cudaError_t launch_elementwise(int64_t r, int64_t k, cudaStream_t stream, Kernel kernel, Args... args) {
  const int64_t n = r * k;
  if (n == 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

cudaError_t moerl_fp8_block_amax(const float* x, int64_t r, int64_t k, int64_t br, int64_t bk, float* amax,
                                 cudaStream_t stream) {
  const int64_t gr = (r + br - 1) / br, gk = (k + bk - 1) / bk;
  if (gr * gk == 0) return cudaSuccess;
  block_amax_kernel<<<static_cast<unsigned>(gr * gk), 256, 0, stream>>>(x, r, k, br, bk, gk, amax);
  return cudaGetLastError();
}

cudaError_t moerl_fp8_quantize(const float* x, int64_t r, int64_t k, int64_t br, int64_t bk, const float* scales,
                               uint8_t* q, cudaStream_t stream) {
  return launch_elementwise(r, k, stream, quantize_kernel, x, r, k, br, bk, (k + bk - 1) / bk, scales,
                            reinterpret_cast<__nv_fp8_storage_t*>(q));
}

cudaError_t moerl_fp8_dequantize(const uint8_t* q, int64_t r, int64_t k, int64_t br, int64_t bk, const float* scales,
                                 float* out, cudaStream_t stream) {
  return launch_elementwise(r, k, stream, dequantize_kernel, reinterpret_cast<const __nv_fp8_storage_t*>(q), r, k, br,
                            bk, (k + bk - 1) / bk, scales, out);
}

}  // extern "C"
