// The block loops of the fused linear log-prob (moerl issue #15), shared by the CPU op
// (csrc/cpu/fused_logprob.cpp) and the CUDA op (csrc/cuda/ops_cuda.cpp): the logits of one
// [token_chunk, vocab_chunk] block, x = h_blk @ W_blk^T, are formed with at::mm_out into one reused
// buffer (cuBLAS on CUDA, the CPU BLAS otherwise) and handed to the device's row kernel.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <tuple>

namespace moerl {

inline at::Tensor logits_block(at::Tensor& buffer, const at::Tensor& h, const at::Tensor& w) {
  at::Tensor x = buffer.narrow(0, 0, h.size(0)).narrow(1, 0, w.size(0));
  if (w.size(0) != buffer.size(1)) x = at::empty({h.size(0), w.size(0)}, h.options());  // the ragged last block
  at::mm_out(x, h, w.t());
  return x;
}

// forward: fold(x [rows, cols], r0, c0) for every block, token blocks outer (the online log-sum-exp of a
// token runs over its vocabulary blocks in order).
template <class Fold>
void forward_blocks(const at::Tensor& hidden, const at::Tensor& weight, int64_t token_chunk, int64_t vocab_chunk,
                    Fold fold) {
  const int64_t n = hidden.size(0), v = weight.size(0);
  at::Tensor buffer = at::empty({std::min(token_chunk, n), std::min(vocab_chunk, v)}, hidden.options());
  for (int64_t r0 = 0; r0 < n; r0 += token_chunk) {
    const at::Tensor h = hidden.narrow(0, r0, std::min(token_chunk, n - r0));
    for (int64_t c0 = 0; c0 < v; c0 += vocab_chunk) {
      fold(logits_block(buffer, h, weight.narrow(0, c0, std::min(vocab_chunk, v - c0))), r0, c0);
    }
  }
}

// backward: grad(x, r0, c0) overwrites each recomputed block with d logits; then dh_blk += dx @ W_blk and
// dW_blk += dx^T @ h_blk. Returns (dh [N, H], dW [V, H]).
template <class Grad>
std::tuple<at::Tensor, at::Tensor> backward_blocks(const at::Tensor& hidden, const at::Tensor& weight,
                                                   int64_t token_chunk, int64_t vocab_chunk, Grad grad) {
  const int64_t n = hidden.size(0), v = weight.size(0);
  at::Tensor dh = at::zeros_like(hidden), dw = at::zeros_like(weight);
  at::Tensor buffer = at::empty({std::min(token_chunk, n), std::min(vocab_chunk, v)}, hidden.options());
  for (int64_t c0 = 0; c0 < v; c0 += vocab_chunk) {
    const int64_t cols = std::min(vocab_chunk, v - c0);
    const at::Tensor w = weight.narrow(0, c0, cols);
    at::Tensor dw_blk = dw.narrow(0, c0, cols);
    for (int64_t r0 = 0; r0 < n; r0 += token_chunk) {
      const int64_t rows = std::min(token_chunk, n - r0);
      const at::Tensor h = hidden.narrow(0, r0, rows);
      at::Tensor x = logits_block(buffer, h, w);
      grad(x, r0, c0);
      dh.narrow(0, r0, rows).addmm_(x, w);
      dw_blk.addmm_(x.t(), h);
    }
  }
  return {dh, dw};
}

}  // namespace moerl
