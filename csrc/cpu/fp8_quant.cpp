// Blockwise FP8 (E4M3) quantise / dequantise, CPU (moerl issue #15).
//
// The scheme of moerl/precision/fp8.py (DeepSeek-V3, arXiv 2412.19437 sec. 3.3): a [R, K] matrix is cut
// into br x bk blocks (1 x 128 activation tiles, 128 x 128 weight blocks; ragged edge blocks use their own
// elements), s = max(amax, 1e-4) / 448 (pow2: 2^ceil(log2 s)), q = e4m3(clamp(x / s, -448, 448)) with
// round-to-nearest-even, dequantised as float(q) * s. The result is bitwise equal to the pure-torch
// reference: amax is a max (exact), the scale is formed from the [R/br, K/bk] amax grid with the very same
// ATen ops the reference uses, x / s is an IEEE float division and the cast is c10::Float8_e4m3fn's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace {

constexpr double kFp8Max = 448.0;
constexpr double kAmaxFloor = 1e-4;

void check_2d(const at::Tensor& x, int64_t br, int64_t bk, const char* what) {
  TORCH_CHECK(x.dim() == 2, "moerl fp8 ", what, ": expected a 2-D tensor, got ", x.sizes());
  TORCH_CHECK(br >= 1 && bk >= 1, "moerl fp8 ", what, ": block sizes must be >= 1");
  TORCH_CHECK(x.device().is_cpu(), "moerl fp8 ", what, ": CPU op called with a non-CPU tensor");
}

std::tuple<at::Tensor, at::Tensor> fp8_quantize_blockwise(const at::Tensor& x_in, int64_t br, int64_t bk, bool pow2) {
  check_2d(x_in, br, bk, "quantize");
  TORCH_CHECK(x_in.is_floating_point(), "moerl fp8 quantize: expected a float tensor");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t r = x.size(0), k = x.size(1);
  const int64_t gr = (r + br - 1) / br, gk = (k + bk - 1) / bk;
  at::Tensor amax = at::zeros({gr, gk}, x.options());
  const float* xp = x.data_ptr<float>();
  float* ap = amax.data_ptr<float>();
  at::parallel_for(0, gr, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) {
      for (int64_t i = g * br; i < std::min(r, (g + 1) * br); ++i) {
        const float* row = xp + i * k;
        for (int64_t c = 0; c < gk; ++c) {
          float m = ap[g * gk + c];
          for (int64_t j = c * bk; j < std::min(k, (c + 1) * bk); ++j) m = std::max(m, std::fabs(row[j]));
          ap[g * gk + c] = m;
        }
      }
    }
  });
  // the reference's scale_from_amax, op for op
  at::Tensor scales = at::clamp_min(amax, kAmaxFloor).div(kFp8Max);
  if (pow2) scales = at::exp2(at::ceil(at::log2(scales)));
  scales = scales.contiguous();
  const float* sp = scales.data_ptr<float>();
  at::Tensor q = at::empty({r, k}, x.options().dtype(at::kFloat8_e4m3fn));
  c10::Float8_e4m3fn* qp = q.data_ptr<c10::Float8_e4m3fn>();
  const float lim = static_cast<float>(kFp8Max);
  at::parallel_for(0, r, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* srow = sp + (i / br) * gk;
      for (int64_t j = 0; j < k; ++j) {
        float v = xp[i * k + j] / srow[j / bk];
        v = std::min(std::max(v, -lim), lim);
        qp[i * k + j] = c10::Float8_e4m3fn(v);
      }
    }
  });
  return {q, scales};
}

at::Tensor fp8_dequantize_blockwise(const at::Tensor& q_in, const at::Tensor& scales_in, int64_t br, int64_t bk) {
  check_2d(q_in, br, bk, "dequantize");
  const int64_t r = q_in.size(0), k = q_in.size(1);
  const int64_t gr = (r + br - 1) / br, gk = (k + bk - 1) / bk;
  TORCH_CHECK(scales_in.dim() == 2 && scales_in.size(0) == gr && scales_in.size(1) == gk,
              "moerl fp8 dequantize: scales ", scales_in.sizes(), " do not match q ", q_in.sizes(), " with ", br, "x", bk,
              " blocks (expected [", gr, ", ", gk, "])");
  const at::Tensor q = q_in.scalar_type() == at::kFloat8_e4m3fn ? q_in.contiguous() : q_in.to(at::kFloat).contiguous();
  const at::Tensor scales = scales_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({r, k}, q.options().dtype(at::kFloat));
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool fp8 = q.scalar_type() == at::kFloat8_e4m3fn;
  const c10::Float8_e4m3fn* q8 = fp8 ? q.data_ptr<c10::Float8_e4m3fn>() : nullptr;
  const float* qf = fp8 ? nullptr : q.data_ptr<float>();
  at::parallel_for(0, r, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* srow = sp + (i / br) * gk;
      for (int64_t j = 0; j < k; ++j) {
        const float v = fp8 ? static_cast<float>(q8[i * k + j]) : qf[i * k + j];
        op[i * k + j] = v * srow[j / bk];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moerl, m) {
  m.def("fp8_quantize_blockwise(Tensor x, int block_rows, int block_cols, bool pow2) -> (Tensor, Tensor)");
  m.def("fp8_dequantize_blockwise(Tensor q, Tensor scales, int block_rows, int block_cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(moerl, CPU, m) {
  m.impl("fp8_quantize_blockwise", &fp8_quantize_blockwise);
  m.impl("fp8_dequantize_blockwise", &fp8_dequantize_blockwise);
}
