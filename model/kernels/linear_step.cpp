// A whole decode step of a linear-attention model (elu + 1 features, learned positions, exact GELU) in one call:
// embeddings, then per block layer norm, the fused q/k/v product, the attention's state update and read, the
// output product added to the residual, layer norm, the feed-forward's products (GELU and the residual add done
// in their epilogues), then the final layer norm and, when the head is a packed linear layer, the logits.
//
// Why one call: with the products at the FMA units' rate (model/kernels/packed_product.h) and the state pass
// at the memory's, what is left of a step is the fixed cost of its few dozen operator calls and the wrappers
// around a compiled graph (benchmarks/results/NOTES.md, "Where a compiled linear step's time goes"). Here there are
// none, and every intermediate stays in a few row buffers that fit in L2. Weights are the decode twin's packed
// ones (model/kernels/packed_linear.py); model/decode/compiled/linear_step.py gathers them and says which models this
// takes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "packed_product.h"

namespace {

constexpr int64_t kMaxHeadDim = 512;  // the longest state line the attention keeps its features for on the stack
constexpr int64_t kPerBlock = 12;  // tensors per block in `weights` (see linear_decode_step)

bool head_dim_taken(int64_t d) { return d > 0 && d % kLanes == 0 && d <= kMaxHeadDim; }

// Rows of x (M, C), C a whole number of vectors, normalised into out: (x - mean) / sqrt(var + eps) * w + b.
void layer_norm(const float* x, float* out, const float* w, const float* b, int64_t m, int64_t c, float eps) {
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * c;
    float* o = out + r * c;
    V sum = vbroadcast(0.f);
    for (int64_t i = 0; i < c; i += kLanes) sum = sum + vload(xr + i);
    const V mean = vbroadcast(hsum(sum) / c);
    V squares = vbroadcast(0.f);
    for (int64_t i = 0; i < c; i += kLanes) {
      const V centred = vload(xr + i) - mean;
      squares = vfma(centred, centred, squares);
    }
    const V scale = vbroadcast(1.f / std::sqrt(hsum(squares) / c + eps));
    for (int64_t i = 0; i < c; i += kLanes) vstore(o + i, vfma((vload(xr + i) - mean) * scale, vload(w + i), vload(b + i)));
  }
}

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

// A packed weight (N / L, K, L) with its bias (N,), checked against the K its product is fed.
struct Packed {
  const float* panels;
  const float* bias;
  int64_t n;
};

Packed packed_weight(const torch::Tensor& panels, const torch::Tensor& bias, int64_t k, const char* what) {
  TORCH_CHECK(panels.scalar_type() == torch::kFloat && panels.dim() == 3 && panels.size(1) == k &&
                  panels.size(2) == kLanes && panels.is_contiguous() && bias.scalar_type() == torch::kFloat &&
                  bias.dim() == 1 && bias.is_contiguous() && panels.size(0) * kLanes >= bias.numel(),
              "linear_decode_step: ", what, " must be a float32 weight packed by pack_linear_weight in this build for ",
              k, " inputs, with a contiguous float32 bias of its outputs; got ", panels.sizes(), " and ", bias.sizes());
  return {panels.data_ptr<float>(), bias.data_ptr<float>(), bias.numel()};
}

const float* vector_of(const torch::Tensor& t, int64_t c, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.dim() == 1 && t.numel() == c && t.is_contiguous(),
              "linear_decode_step: ", what, " must be a contiguous float32 vector of ", c, " numbers, got ", t.sizes());
  return t.data_ptr<float>();
}

void check_inputs(const torch::Tensor& tokens, const torch::Tensor& lengths, const torch::Tensor& tok_emb,
                  const torch::Tensor& pos_emb, int64_t m) {
  TORCH_CHECK(tokens.scalar_type() == torch::kLong && tokens.dim() == 1 && tokens.is_contiguous() &&
                  lengths.scalar_type() == torch::kLong && lengths.dim() == 1 && lengths.numel() == m &&
                  lengths.is_contiguous(),
              "linear_decode_step: tokens and lengths must be contiguous int64 vectors of one number a row, got ",
              tokens.sizes(), " and ", lengths.sizes());
  TORCH_CHECK(tok_emb.scalar_type() == torch::kFloat && pos_emb.scalar_type() == torch::kFloat &&
                  tok_emb.dim() == 2 && pos_emb.dim() == 2 && tok_emb.size(1) == pos_emb.size(1) &&
                  tok_emb.is_contiguous() && pos_emb.is_contiguous() && tok_emb.size(1) % kLanes == 0,
              "linear_decode_step: contiguous float32 token and position embeddings of one width, a multiple of ",
              kLanes, ", got ", tok_emb.sizes(), " and ", pos_emb.sizes());
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(tok[r] >= 0 && tok[r] < tok_emb.size(0), "linear_decode_step: row ", r, "'s token ", tok[r],
                " is outside the vocabulary of ", tok_emb.size(0));
    TORCH_CHECK(len[r] >= 0 && len[r] < pos_emb.size(0), "linear_decode_step: row ", r, " is at position ", len[r],
                ", past the model's ", pos_emb.size(0), " positions");
  }
}

float* state_of(const torch::Tensor& state, int64_t m, int64_t heads, int64_t d) {
  TORCH_CHECK(state.scalar_type() == torch::kFloat && state.is_contiguous() && state.dim() == 4 &&
                  state.size(0) == m && state.size(1) == heads && state.size(2) == d + 1 && state.size(3) == d,
              "linear_decode_step: each block's state must be a contiguous float32 (B, H, D + 1, D) = (", m, ", ",
              heads, ", ", d + 1, ", ", d, "), got ", state.sizes());
  return state.data_ptr<float>();
}

// One block's weights and state, checked.
struct BlockWeights {
  const float *ln_attn_w, *ln_attn_b;
  Packed qkv, proj;
  const float *ln_ff_w, *ln_ff_b;
  Packed up, down;
  float* state;
};

// w: the block's kPerBlock tensors (see linear_decode_step), checked against a width of c and a feed-forward of ff.
BlockWeights block_weights(const torch::Tensor* w, float* state, int64_t l, int64_t c, int64_t ff) {
  const BlockWeights b{vector_of(w[0], c, "ln_attn.weight"), vector_of(w[1], c, "ln_attn.bias"),
                       packed_weight(w[2], w[3], c, "qkv"),  packed_weight(w[4], w[5], c, "proj"),
                       vector_of(w[6], c, "ln_ff.weight"),   vector_of(w[7], c, "ln_ff.bias"),
                       packed_weight(w[8], w[9], c, "up"),   packed_weight(w[10], w[11], ff, "down"),
                       state};
  TORCH_CHECK(b.qkv.n == 3 * c && b.proj.n == c && b.up.n == ff && b.down.n == c, "linear_decode_step: block ", l,
              "'s products must map ", c, " -> ", 3 * c, ", ", c, " -> ", c, ", ", c, " -> ", ff, " -> ", c);
  return b;
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
  const int64_t given = weights.size() - kPerBlock * blocks;
  TORCH_CHECK(given == 2 || given == 4, "linear_decode_step: ", kPerBlock, " weights per block and 2 or 4 after them "
              "for ", blocks, " blocks, got ", weights.size());
  check_inputs(tokens, lengths, tok_emb, pos_emb, m);
  const int64_t d = c / heads, ff = blocks ? weights[9].numel() : 0;
  // Every input checked before anything is written: a refused call leaves the state as it was.
  std::vector<BlockWeights> checked;
  for (int64_t l = 0; l < blocks; ++l)
    checked.push_back(block_weights(&weights[kPerBlock * l], state_of(states[l], m, heads, d), l, c, ff));
  const torch::Tensor* last = &weights[kPerBlock * blocks];
  const float *final_w = vector_of(last[0], c, "ln_f.weight"), *final_b = vector_of(last[1], c, "ln_f.bias");
  const Packed head = given == 4 ? packed_weight(last[2], last[3], c, "head") : Packed{nullptr, nullptr, 0};

  const auto options = tok_emb.options();
  auto x = torch::empty({m, c}, options), normed = torch::empty({m, c}, options),
       qkv = torch::empty({m, 3 * c}, options), y = torch::empty({m, c}, options), mid = torch::empty({m, ff}, options);
  float *xp = x.data_ptr<float>(), *np = normed.data_ptr<float>(), *qkvp = qkv.data_ptr<float>(),
        *yp = y.data_ptr<float>(), *midp = mid.data_ptr<float>();
  int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    const float* token = tok_emb.data_ptr<float>() + tok[r] * c;
    const float* position = pos_emb.data_ptr<float>() + len[r] * c;
    for (int64_t i = 0; i < c; i += kLanes) vstore(xp + r * c + i, vload(token + i) + vload(position + i));
  }
  for (const BlockWeights& b : checked) {
    layer_norm(xp, np, b.ln_attn_w, b.ln_attn_b, m, c, ln_eps);
    packed_product({np, b.qkv.panels, b.qkv.bias, qkvp, m, c, 3 * c});
    attention(qkvp, yp, b.state, m, heads, d, attn_eps);
    packed_product({yp, b.proj.panels, b.proj.bias, xp, m, c, c, Epilogue::kAccumulate});
    layer_norm(xp, np, b.ln_ff_w, b.ln_ff_b, m, c, ln_eps);
    packed_product({np, b.up.panels, b.up.bias, midp, m, c, ff, Epilogue::kGelu});
    packed_product({midp, b.down.panels, b.down.bias, xp, m, ff, c, Epilogue::kAccumulate});
  }
  layer_norm(xp, np, final_w, final_b, m, c, ln_eps);
  for (int64_t r = 0; r < m; ++r) ++len[r];
  if (!head.panels) return normed;
  auto logits = torch::empty({m, head.n}, options);
  packed_product({np, head.panels, head.bias, logits.data_ptr<float>(), m, c, head.n});
  return logits;
}

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("linear_step_takes_head(int d) -> bool", &linear_step_takes_head);
  m.def(
      "linear_decode_step(Tensor tokens, Tensor(a!) lengths, Tensor tok_emb, Tensor pos_emb, Tensor[] weights, "
      "Tensor(b!)[] states, int heads, float ln_eps, float attn_eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(rnnserve, CPU, m) { m.impl("linear_decode_step", &linear_decode_step); }
