// CUDA implementations of the torch.ops.moerl ops defined in csrc/cpu (moerl issue #15): the block loop
// of the fused linear log-prob (cuBLAS GEMMs through at::mm_out / addmm_, row work in fused_logprob.cu)
// and the blockwise FP8 quantiser (fp8_quant.cu). Built by moerl/kernels/_build.py with
// torch.utils.cpp_extension.load on a CUDA machine, after the CPU library that defines the op schemas.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "moerl_blocks.h"

#include <cuda_runtime.h>

extern "C" {
cudaError_t moerl_lse_block(const float* x, int64_t rows, int64_t cols, int64_t ld, float inv_t, const int64_t* labels,
                            int64_t col_offset, float* stats, cudaStream_t stream);
cudaError_t moerl_softmax_grad_block(float* x, int64_t rows, int64_t cols, int64_t ld, float inv_t,
                                     const int64_t* labels, int64_t col_offset, const float* lse, const float* mean,
                                     const float* g_lp, const float* g_ent, cudaStream_t stream);
cudaError_t moerl_fp8_block_amax(const float* x, int64_t r, int64_t k, int64_t br, int64_t bk, float* amax,
                                 cudaStream_t stream);
cudaError_t moerl_fp8_quantize(const float* x, int64_t r, int64_t k, int64_t br, int64_t bk, const float* scales,
                               uint8_t* q, cudaStream_t stream);
cudaError_t moerl_fp8_dequantize(const uint8_t* q, int64_t r, int64_t k, int64_t br, int64_t bk, const float* scales,
                                 float* out, cudaStream_t stream);
}

namespace {

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "moerl CUDA kernel ", what, " failed: ", cudaGetErrorString(err));
}

void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "moerl fused_logprob: hidden [N, H] and weight [V, H] expected, got ", hidden.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "moerl fused_logprob: hidden and weight must be float32");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == hidden.size(0) && labels.scalar_type() == at::kLong,
              "moerl fused_logprob: labels must be int64 [N]");
  TORCH_CHECK(hidden.is_cuda() && weight.is_cuda() && labels.is_cuda(), "moerl fused_logprob CUDA op: CUDA tensors expected");
}

at::Tensor fused_logprob_fwd_cuda(const at::Tensor& hidden_in, const at::Tensor& weight_in, const at::Tensor& labels_in,
                                  double temperature, int64_t vocab_start, int64_t token_chunk, int64_t vocab_chunk) {
  check_inputs(hidden_in, weight_in, labels_in);
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous(), labels = labels_in.contiguous();
  const int64_t n = hidden.size(0);
  const float inv_t = static_cast<float>(1.0 / temperature);
  at::Tensor stats = at::zeros({n, 4}, hidden.options());
  stats.select(1, 0).fill_(-std::numeric_limits<float>::infinity());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* lab = labels.data_ptr<int64_t>();
  float* st = stats.data_ptr<float>();
  moerl::forward_blocks(hidden, weight, token_chunk, vocab_chunk, [&](const at::Tensor& x, int64_t r0, int64_t c0) {
    check(moerl_lse_block(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), inv_t, lab + r0, vocab_start + c0,
                          st + 4 * r0, stream),
          "lse_block");
  });
  return stats;
}

std::tuple<at::Tensor, at::Tensor> fused_logprob_bwd_cuda(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                                                          const at::Tensor& labels_in, double temperature,
                                                          int64_t vocab_start, const at::Tensor& lse,
                                                          const at::Tensor& mean, const at::Tensor& g_lp,
                                                          const at::Tensor& g_ent, int64_t token_chunk,
                                                          int64_t vocab_chunk) {
  check_inputs(hidden_in, weight_in, labels_in);
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous(), labels = labels_in.contiguous();
  const at::Tensor l = lse.contiguous(), mu = mean.contiguous(), a = g_lp.contiguous(), g = g_ent.contiguous();
  const float inv_t = static_cast<float>(1.0 / temperature);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* lab = labels.data_ptr<int64_t>();
  return moerl::backward_blocks(hidden, weight, token_chunk, vocab_chunk, [&](at::Tensor& x, int64_t r0, int64_t c0) {
    check(moerl_softmax_grad_block(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), inv_t, lab + r0,
                                   vocab_start + c0, l.data_ptr<float>() + r0, mu.data_ptr<float>() + r0,
                                   a.data_ptr<float>() + r0, g.data_ptr<float>() + r0, stream),
          "softmax_grad_block");
  });
}

std::tuple<at::Tensor, at::Tensor> fp8_quantize_blockwise_cuda(const at::Tensor& x_in, int64_t br, int64_t bk, bool pow2) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_cuda() && br >= 1 && bk >= 1, "moerl fp8 quantize: 2-D CUDA tensor expected");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t r = x.size(0), k = x.size(1), gr = (r + br - 1) / br, gk = (k + bk - 1) / bk;
  auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor amax = at::empty({gr, gk}, x.options());
  check(moerl_fp8_block_amax(x.data_ptr<float>(), r, k, br, bk, amax.data_ptr<float>(), stream), "fp8_block_amax");
  at::Tensor scales = at::clamp_min(amax, 1e-4).div(448.0);  // moerl.precision.fp8.scale_from_amax, op for op
  if (pow2) scales = at::exp2(at::ceil(at::log2(scales)));
  scales = scales.contiguous();
  at::Tensor q = at::empty({r, k}, x.options().dtype(at::kFloat8_e4m3fn));
  check(moerl_fp8_quantize(x.data_ptr<float>(), r, k, br, bk, scales.data_ptr<float>(),
                           reinterpret_cast<uint8_t*>(q.data_ptr()), stream),
        "fp8_quantize");
  return {q, scales};
}

at::Tensor fp8_dequantize_blockwise_cuda(const at::Tensor& q_in, const at::Tensor& scales_in, int64_t br, int64_t bk) {
  TORCH_CHECK(q_in.dim() == 2 && q_in.is_cuda() && q_in.scalar_type() == at::kFloat8_e4m3fn,
              "moerl fp8 dequantize: 2-D float8_e4m3fn CUDA tensor expected");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t r = q_in.size(0), k = q_in.size(1), gr = (r + br - 1) / br, gk = (k + bk - 1) / bk;
  TORCH_CHECK(scales_in.dim() == 2 && scales_in.size(0) == gr && scales_in.size(1) == gk,
              "moerl fp8 dequantize: scales ", scales_in.sizes(), " do not match q ", q_in.sizes());
  const at::Tensor q = q_in.contiguous(), scales = scales_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({r, k}, q.options().dtype(at::kFloat));
  check(moerl_fp8_dequantize(reinterpret_cast<const uint8_t*>(q.data_ptr()), r, k, br, bk, scales.data_ptr<float>(),
                             out.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()),
        "fp8_dequantize");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(moerl, CUDA, m) {
  m.impl("fused_logprob_fwd", &fused_logprob_fwd_cuda);
  m.impl("fused_logprob_bwd", &fused_logprob_bwd_cuda);
  m.impl("fp8_quantize_blockwise", &fp8_quantize_blockwise_cuda);
  m.impl("fp8_dequantize_blockwise", &fp8_dequantize_blockwise_cuda);
}
