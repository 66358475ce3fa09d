// What a whole decode step in one call does around its attention, whatever the kind (model/kernels/linear_step.cpp,
// model/kernels/hybrid_step.cpp): the embeddings, then per block layer norm, the fused q/k/v product, the kind's
// attention, the output product added to the residual, layer norm, the feed-forward's products (GELU and the residual
// add done in their epilogues), then the final layer norm and, when the head is a packed linear layer, the logits.
// Weights are a decode twin's packed ones (model/kernels/packed_linear.py), checked here with the op's name in every
// message.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "packed_product.h"

namespace {

constexpr int64_t kPerBlock = 12;  // tensors per block in a step's `weights` (see `step_weights`)

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

// A packed weight (N / L, K, L) with its bias (N,), checked against the K its product is fed.
struct Packed {
  const float* panels;
  const float* bias;
  int64_t n;
};

Packed packed_weight(const torch::Tensor& panels, const torch::Tensor& bias, int64_t k, const char* op,
                     const char* what) {
  TORCH_CHECK(panels.scalar_type() == torch::kFloat && panels.dim() == 3 && panels.size(1) == k &&
                  panels.size(2) == kLanes && panels.is_contiguous() && bias.scalar_type() == torch::kFloat &&
                  bias.dim() == 1 && bias.is_contiguous() && panels.size(0) * kLanes >= bias.numel(),
              op, ": ", what, " must be a float32 weight packed by pack_linear_weight in this build for ", k,
              " inputs, with a contiguous float32 bias of its outputs; got ", panels.sizes(), " and ", bias.sizes());
  return {panels.data_ptr<float>(), bias.data_ptr<float>(), bias.numel()};
}

const float* vector_of(const torch::Tensor& t, int64_t c, const char* op, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.dim() == 1 && t.numel() == c && t.is_contiguous(), op, ": ", what,
              " must be a contiguous float32 vector of ", c, " numbers, got ", t.sizes());
  return t.data_ptr<float>();
}

// Tokens (M,) at positions lengths (M,), both in range of the embeddings.
void check_tokens(const torch::Tensor& tokens, const torch::Tensor& lengths, const torch::Tensor& tok_emb,
                  const torch::Tensor& pos_emb, int64_t m, const char* op) {
  TORCH_CHECK(tokens.scalar_type() == torch::kLong && tokens.dim() == 1 && tokens.is_contiguous() &&
                  lengths.scalar_type() == torch::kLong && lengths.dim() == 1 && lengths.numel() == m &&
                  lengths.is_contiguous(),
              op, ": tokens and lengths must be contiguous int64 vectors of one number a row, got ", tokens.sizes(),
              " and ", lengths.sizes());
  TORCH_CHECK(tok_emb.scalar_type() == torch::kFloat && pos_emb.scalar_type() == torch::kFloat &&
                  tok_emb.dim() == 2 && pos_emb.dim() == 2 && tok_emb.size(1) == pos_emb.size(1) &&
                  tok_emb.is_contiguous() && pos_emb.is_contiguous() && tok_emb.size(1) % kLanes == 0,
              op, ": contiguous float32 token and position embeddings of one width, a multiple of ", kLanes, ", got ",
              tok_emb.sizes(), " and ", pos_emb.sizes());
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(tok[r] >= 0 && tok[r] < tok_emb.size(0), op, ": row ", r, "'s token ", tok[r],
                " is outside the vocabulary of ", tok_emb.size(0));
    TORCH_CHECK(len[r] >= 0 && len[r] < pos_emb.size(0), op, ": row ", r, " is at position ", len[r],
                ", past the model's ", pos_emb.size(0), " positions");
  }
}

// One block's weights, checked.
struct BlockWeights {
  const float *ln_attn_w, *ln_attn_b;
  Packed qkv, proj;
  const float *ln_ff_w, *ln_ff_b;
  Packed up, down;
};

// Every block's weights, then the final layer norm's and the head's (panels null when it runs after the call).
struct StepWeights {
  std::vector<BlockWeights> blocks;
  const float *final_w, *final_b;
  Packed head;
  int64_t c, qkv_width, ff;  // the model's width, the fused product's outputs, the feed-forward's
};

// w: a block's kPerBlock tensors [ln_attn w, b, qkv packed, bias, proj packed, bias, ln_ff w, b, up packed, bias,
// down packed, bias], checked against a width of c, a fused product of qkv_width outputs and a feed-forward of ff.
BlockWeights block_weights(const torch::Tensor* w, int64_t l, int64_t c, int64_t qkv_width, int64_t ff,
                           const char* op) {
  const BlockWeights b{vector_of(w[0], c, op, "ln_attn.weight"), vector_of(w[1], c, op, "ln_attn.bias"),
                       packed_weight(w[2], w[3], c, op, "qkv"),  packed_weight(w[4], w[5], c, op, "proj"),
                       vector_of(w[6], c, op, "ln_ff.weight"),   vector_of(w[7], c, op, "ln_ff.bias"),
                       packed_weight(w[8], w[9], c, op, "up"),   packed_weight(w[10], w[11], ff, op, "down")};
  TORCH_CHECK(b.qkv.n == qkv_width && b.proj.n == c && b.up.n == ff && b.down.n == c, op, ": block ", l,
              "'s products must map ", c, " -> ", qkv_width, ", ", c, " -> ", c, ", ", c, " -> ", ff, " -> ", c);
  return b;
}

// weights: kPerBlock per block, then [ln_f w, b] and optionally [head packed, bias]; all checked.
StepWeights step_weights(at::TensorList weights, int64_t blocks, int64_t c, int64_t qkv_width, const char* op) {
  const int64_t given = weights.size() - kPerBlock * blocks;
  TORCH_CHECK(given == 2 || given == 4, op, ": ", kPerBlock, " weights per block and 2 or 4 after them for ", blocks,
              " blocks, got ", weights.size());
  StepWeights s{{}, nullptr, nullptr, {nullptr, nullptr, 0}, c, qkv_width, blocks ? weights[9].numel() : 0};
  for (int64_t l = 0; l < blocks; ++l) s.blocks.push_back(block_weights(&weights[kPerBlock * l], l, c, qkv_width, s.ff, op));
  const torch::Tensor* last = &weights[kPerBlock * blocks];
  s.final_w = vector_of(last[0], c, op, "ln_f.weight");
  s.final_b = vector_of(last[1], c, op, "ln_f.bias");
  if (given == 4) s.head = packed_weight(last[2], last[3], c, op, "head");
  return s;
}

// The step: tokens (M,) at positions lengths (M,) -> logits (M, N), or the final layer norm's output (M, C) when
// no head is given; the lengths move on in place. attend(l, qkv (M, qkv_width), y (M, C)) is block l's attention,
// which moves its state on.
template <class Attend>
torch::Tensor run_step(const torch::Tensor& tokens, const torch::Tensor& lengths, const torch::Tensor& tok_emb,
                       const torch::Tensor& pos_emb, const StepWeights& w, double ln_eps, const Attend& attend) {
  const int64_t m = tokens.numel(), c = w.c;
  const auto options = tok_emb.options();
  auto x = torch::empty({m, c}, options), normed = torch::empty({m, c}, options),
       qkv = torch::empty({m, w.qkv_width}, options), y = torch::empty({m, c}, options),
       mid = torch::empty({m, w.ff}, options);
  float *xp = x.data_ptr<float>(), *np = normed.data_ptr<float>(), *qkvp = qkv.data_ptr<float>(),
        *yp = y.data_ptr<float>(), *midp = mid.data_ptr<float>();
  int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    const float* token = tok_emb.data_ptr<float>() + tok[r] * c;
    const float* position = pos_emb.data_ptr<float>() + len[r] * c;
    for (int64_t i = 0; i < c; i += kLanes) vstore(xp + r * c + i, vload(token + i) + vload(position + i));
  }
  for (size_t l = 0; l < w.blocks.size(); ++l) {
    const BlockWeights& b = w.blocks[l];
    layer_norm(xp, np, b.ln_attn_w, b.ln_attn_b, m, c, ln_eps);
    packed_product({np, b.qkv.panels, b.qkv.bias, qkvp, m, c, w.qkv_width});
    attend(static_cast<int64_t>(l), static_cast<const float*>(qkvp), yp);
    packed_product({yp, b.proj.panels, b.proj.bias, xp, m, c, c, Epilogue::kAccumulate});
    layer_norm(xp, np, b.ln_ff_w, b.ln_ff_b, m, c, ln_eps);
    packed_product({np, b.up.panels, b.up.bias, midp, m, c, w.ff, Epilogue::kGelu});
    packed_product({midp, b.down.panels, b.down.bias, xp, m, w.ff, c, Epilogue::kAccumulate});
  }
  layer_norm(xp, np, w.final_w, w.final_b, m, c, ln_eps);
  for (int64_t r = 0; r < m; ++r) ++len[r];
  if (!w.head.panels) return normed;
  auto logits = torch::empty({m, w.head.n}, options);
  packed_product({np, w.head.panels, w.head.bias, logits.data_ptr<float>(), m, c, w.head.n});
  return logits;
}

}  // namespace
