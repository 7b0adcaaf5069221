// Fused linear log-prob + entropy, CPU (moerl issue #15).
//
// From hidden states h [N, H] and an output-layer weight (or its vocabulary-parallel shard) W [V, H],
// x = (h @ W^T) / T is formed one [token_chunk, vocab_chunk] block at a time (at::mm on the block) and
// reduced at once with an online log-sum-exp (Milakov & Gimelshein 2018, "Online normalizer calculation
// for softmax", arXiv 1805.02867), so no [N, V] tensor ever exists.
//
//   forward  -> stats [N, 4] float32 per token over this shard's columns:
//               (m = max x, s = sum exp(x - m), t = sum exp(x - m) * x, target logit or 0)
//               the caller combines shards (TP all-reduce) and forms lse = m + log s,
//               entropy = lse - t / s, log_prob = target - lse.
//   backward -> d x_k = (g_lp * (1[k = label] - p_k) - g_ent * p_k * (x_k - mean_x)) / T with
//               p_k = exp(x_k - lse) (the block is recomputed), then dh += dx @ W_blk, dW_blk += dx^T @ h.
//
// Rows are processed with at::parallel_for; exp is a branch-free polynomial that GCC vectorises.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "moerl_blocks.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// exp(x) for x <= ~88, ~2 ulp: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2, degree-6
// minimax polynomial (the Cephes expf coefficients), scale by 2^n through the exponent bits.
// Below -87.3 it returns 0 (the flush a softmax wants). Branch-free so loops over it vectorise.
static inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.3f ? 88.3f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  float out = p * scale;
  return x <= -87.3f ? 0.0f : out;
}

void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2, "moerl fused_logprob: hidden must be [N, H] and weight [V, H], got ",
              hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK(hidden.size(1) == weight.size(1), "moerl fused_logprob: hidden [N, H] and weight [V, H] disagree on H: ",
              hidden.sizes(), " vs ", weight.sizes());
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "moerl fused_logprob: hidden and weight must be float32 (the Python wrapper casts)");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == hidden.size(0) && labels.scalar_type() == at::kLong,
              "moerl fused_logprob: labels must be int64 [N] matching hidden, got ", labels.sizes());
  TORCH_CHECK(hidden.device().is_cpu() && weight.device().is_cpu() && labels.device().is_cpu(),
              "moerl fused_logprob CPU op called with non-CPU tensors");
}

at::Tensor fused_logprob_fwd(const at::Tensor& hidden_in, const at::Tensor& weight_in, const at::Tensor& labels_in,
                             double temperature, int64_t vocab_start, int64_t token_chunk, int64_t vocab_chunk) {
  check_inputs(hidden_in, weight_in, labels_in);
  TORCH_CHECK(temperature > 0 && token_chunk > 0 && vocab_chunk > 0, "moerl fused_logprob: temperature and chunks must be > 0");
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous(), labels = labels_in.contiguous();
  const int64_t n = hidden.size(0);
  const float inv_t = static_cast<float>(1.0 / temperature);
  at::Tensor stats = at::empty({n, 4}, hidden.options());
  float* st = stats.data_ptr<float>();
  const int64_t* lab = labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    st[4 * i + 0] = -std::numeric_limits<float>::infinity();
    st[4 * i + 1] = 0.f;
    st[4 * i + 2] = 0.f;
    st[4 * i + 3] = 0.f;
  }
  moerl::forward_blocks(hidden, weight, token_chunk, vocab_chunk, [&](const at::Tensor& x, int64_t r0, int64_t c0) {
    const int64_t rows = x.size(0), cols = x.size(1), ld = x.stride(0);
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float* row = xp + i * ld;
        float mc = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < cols; ++k) mc = std::max(mc, row[k] * inv_t);
        float* s = st + 4 * (r0 + i);
        const float m_new = std::max(s[0], mc);
        const float rescale = s[1] > 0.f ? fast_exp(s[0] - m_new) : 0.f;
        // double accumulators: a float sum of a vocab block has ~sqrt(cols / lanes) eps of error, 1.5e-6
        // relative with AVX2's 8 lanes at V = 1000 (the entropy then 1e-5 off float64, tests/test_kernels.py);
        // in double the float32 logits are the only error left
        double se = 0.0, sx = 0.0;
#pragma omp simd reduction(+ : se, sx)
        for (int64_t k = 0; k < cols; ++k) {
          const float xs = row[k] * inv_t;
          const float e_ = fast_exp(xs - m_new);
          se += static_cast<double>(e_);
          sx += static_cast<double>(e_) * static_cast<double>(xs);
        }
        s[0] = m_new;
        s[1] = static_cast<float>(static_cast<double>(s[1]) * rescale + se);
        s[2] = static_cast<float>(static_cast<double>(s[2]) * rescale + sx);
        const int64_t local = lab[r0 + i] - vocab_start - c0;
        if (local >= 0 && local < cols) s[3] = row[local] * inv_t;
      }
    });
  });
  return stats;
}

std::tuple<at::Tensor, at::Tensor> fused_logprob_bwd(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                                                     const at::Tensor& labels_in, double temperature, int64_t vocab_start,
                                                     const at::Tensor& lse_in, const at::Tensor& mean_in,
                                                     const at::Tensor& g_lp_in, const at::Tensor& g_ent_in,
                                                     int64_t token_chunk, int64_t vocab_chunk) {
  check_inputs(hidden_in, weight_in, labels_in);
  const int64_t n = hidden_in.size(0);
  for (const at::Tensor* t : {&lse_in, &mean_in, &g_lp_in, &g_ent_in})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == n && t->scalar_type() == at::kFloat,
                "moerl fused_logprob backward: per-token inputs must be float32 [N]");
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous(), labels = labels_in.contiguous();
  const at::Tensor lse = lse_in.contiguous(), mean = mean_in.contiguous(), g_lp = g_lp_in.contiguous(),
                   g_ent = g_ent_in.contiguous();
  const float inv_t = static_cast<float>(1.0 / temperature);
  const int64_t* lab = labels.data_ptr<int64_t>();
  const float *lp = lse.data_ptr<float>(), *mp = mean.data_ptr<float>(), *gl = g_lp.data_ptr<float>(),
              *ge = g_ent.data_ptr<float>();
  return moerl::backward_blocks(hidden, weight, token_chunk, vocab_chunk, [&](at::Tensor& x, int64_t r0, int64_t c0) {
    const int64_t rows = x.size(0), cols = x.size(1), ld = x.stride(0);
    float* xp = x.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        float* row = xp + i * ld;
        const int64_t t = r0 + i;
        const float l = lp[t], mu = mp[t], a = gl[t], g = ge[t];
#pragma omp simd
        for (int64_t k = 0; k < cols; ++k) {
          const float xs = row[k] * inv_t;
          const float p = fast_exp(xs - l);
          row[k] = -p * (a + g * (xs - mu)) * inv_t;
        }
        const int64_t local = lab[t] - vocab_start - c0;
        if (local >= 0 && local < cols) row[local] += a * inv_t;
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moerl, m) {
  m.def("fused_logprob_fwd(Tensor hidden, Tensor weight, Tensor labels, float temperature, int vocab_start, "
        "int token_chunk, int vocab_chunk) -> Tensor");
  m.def("fused_logprob_bwd(Tensor hidden, Tensor weight, Tensor labels, float temperature, int vocab_start, "
        "Tensor lse, Tensor mean_x, Tensor g_lp, Tensor g_ent, int token_chunk, int vocab_chunk) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moerl, CPU, m) {
  m.impl("fused_logprob_fwd", &fused_logprob_fwd);
  m.impl("fused_logprob_bwd", &fused_logprob_bwd);
}
