// A whole decode step of a linear-attention model (elu + 1 features, learned positions, exact GELU) in one call:
// the block around the attention is model/kernels/decode_block.h's; here is the attention's state update and read.
//
// Why one call: with the products at the FMA units' rate (model/kernels/packed_product.h) and the state pass
// at the memory's, what is left of a step is the fixed cost of its few dozen operator calls and the wrappers
// around a compiled graph (benchmarks/results/NOTES.md, "Where a compiled linear step's time goes"). Here there are
// none, and every intermediate stays in a few row buffers that fit in L2. Weights are the decode twin's packed
// ones (model/kernels/packed_linear.py); model/decode/compiled/linear_step.py gathers them and says which models this
// takes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "decode_block.h"

namespace {

constexpr int64_t kMaxHeadDim = 512;  // the longest state line the attention keeps its features for on the stack

bool head_dim_taken(int64_t d) { return d > 0 && d % kLanes == 0 && d <= kMaxHeadDim; }

// One row's head: [S | Z]^T (D + 1 lines of D) += [v; 1] phi(k)^T, then y = phi(q)^T S / (phi(q)^T Z + eps), in
// one pass over the state (each line updated and read while in registers). C vectors a line, or (C = 0) `chunks`.
template <int C>
void attend(const float* q, const float* k, const float* v, float* state, float* y, int64_t chunks, float eps) {
  constexpr int64_t kHeld = C ? C : kMaxHeadDim / kLanes;
  const int64_t count = C ? C : chunks, d = count * kLanes;
  V qs[kHeld], ks[kHeld];
  for (int64_t c = 0; c < count; ++c) {
    qs[c] = elu_plus_one(vload(q + c * kLanes));
    ks[c] = elu_plus_one(vload(k + c * kLanes));
  }
  auto line = [&](int64_t j, float value) {  // line j += value phi(k); returns phi(q) . line j
    float* at = state + j * d;
    const V scale = vbroadcast(value);
    V sum = vbroadcast(0.f);
    for (int64_t c = 0; c < count; ++c) {
      const V updated = vfma(scale, ks[c], vload(at + c * kLanes));
      vstore(at + c * kLanes, updated);
      sum = vfma(qs[c], updated, sum);
    }
    return hsum(sum);
  };
  const float inverse = 1.f / (line(d, 1.f) + eps);
  for (int64_t j = 0; j < d; ++j) y[j] = line(j, v[j]) * inverse;
}

// Every row and head of one block's attention: qkv (M, 3 C) -> y (M, C), states (M, H, D + 1, D) in place.
void attention(const float* qkv, float* y, float* states, int64_t m, int64_t heads, int64_t d, float eps) {
  const int64_t width = heads * d, chunks = d / kLanes;
  at::parallel_for(0, m * heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const int64_t r = g / heads, h = g % heads;
      const float* q = qkv + r * 3 * width + h * d;
      float* s = states + g * (d + 1) * d;
      float* out = y + r * width + h * d;
      switch (chunks) {
        case 1: attend<1>(q, q + width, q + 2 * width, s, out, chunks, eps); break;
        case 2: attend<2>(q, q + width, q + 2 * width, s, out, chunks, eps); break;
        case 4: attend<4>(q, q + width, q + 2 * width, s, out, chunks, eps); break;
        case 8: attend<8>(q, q + width, q + 2 * width, s, out, chunks, eps); break;
        default: attend<0>(q, q + width, q + 2 * width, s, out, chunks, eps); break;
      }
    }
  });
}

float* state_of(const torch::Tensor& state, int64_t m, int64_t heads, int64_t d) {
  TORCH_CHECK(state.scalar_type() == torch::kFloat && state.is_contiguous() && state.dim() == 4 &&
                  state.size(0) == m && state.size(1) == heads && state.size(2) == d + 1 && state.size(3) == d,
              "linear_decode_step: each block's state must be a contiguous float32 (B, H, D + 1, D) = (", m, ", ",
              heads, ", ", d + 1, ", ", d, "), got ", state.sizes());
  return state.data_ptr<float>();
}

}  // namespace

// Whether this build's step takes heads of d numbers (a whole number of its vectors, up to kMaxHeadDim).
bool linear_step_takes_head(int64_t d) { return head_dim_taken(d); }

// tokens (B,) at positions lengths (B,) -> logits (B, N), or the final layer norm's output (B, C) when no head is
// given; every block's state (B, H, D + 1, D) and the lengths move on in place. weights: per block
// [ln_attn w, b, qkv packed, bias, proj packed, bias, ln_ff w, b, up packed, bias, down packed, bias], then
// [ln_f w, b] and optionally [head packed, bias].
torch::Tensor linear_decode_step(const torch::Tensor& tokens, const torch::Tensor& lengths, const torch::Tensor& tok_emb,
                                 const torch::Tensor& pos_emb, at::TensorList weights, at::TensorList states,
                                 int64_t heads, double ln_eps, double attn_eps) {
  const int64_t m = tokens.numel(), c = tok_emb.size(1), blocks = states.size();
  TORCH_CHECK(heads > 0 && c % heads == 0 && head_dim_taken(c / heads),
              "linear_decode_step: heads of ", c, " / ", heads, " numbers; this build takes a multiple of ", kLanes,
              " up to ", kMaxHeadDim);
  check_tokens(tokens, lengths, tok_emb, pos_emb, m, "linear_decode_step");
  const int64_t d = c / heads;
  // Every input checked before anything is written: a refused call leaves the state as it was.
  const StepWeights checked = step_weights(weights, blocks, c, 3 * c, "linear_decode_step");
  std::vector<float*> state;
  for (int64_t l = 0; l < blocks; ++l) state.push_back(state_of(states[l], m, heads, d));
  return run_step(tokens, lengths, tok_emb, pos_emb, checked, ln_eps, [&](int64_t l, const float* qkv, float* y) {
    attention(qkv, y, state[l], m, heads, d, attn_eps);
  });
}

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("linear_step_takes_head(int d) -> bool", &linear_step_takes_head);
  m.def(
      "linear_decode_step(Tensor tokens, Tensor(a!) lengths, Tensor tok_emb, Tensor pos_emb, Tensor[] weights, "
      "Tensor(b!)[] states, int heads, float ln_eps, float attn_eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(rnnserve, CPU, m) { m.impl("linear_decode_step", &linear_decode_step); }
