// A whole decode step of a hybrid-attention model (learned positions, exact GELU, GPT-2's block with its biases; any
// feature map and grouped-query heads the attention kernel takes) in one call: model/kernels/decode_block.h's block
// around model/kernels/hybrid_attention.h's attention.
//
// Why one call: as for linear_step.cpp, what a compiled graph adds around the attention (its wrappers, an operator
// call per product, norm and feature map) is a large part of a step at batch 64; here there is none, and the rows'
// q, k and v are read where the fused product leaves them. model/decode/compiled/hybrid_step.py gathers the weights
// and says which models this takes.
#include <torch/extension.h>

#include <vector>

#include "decode_block.h"
#include "hybrid_attention.h"

namespace {

constexpr const char* kStepOp = "hybrid_decode_step";
constexpr int64_t kStatePerBlock = 4;  // ring_k, ring_v, s, z

// Each block's attention, checked: states 4 per block, mixes 1, maps 2 (weight, bias) for t2r and Hedgehog or none.
std::vector<HybridLayer> hybrid_layers(at::TensorList states, at::TensorList mixes, at::TensorList maps,
                                       int64_t blocks, int64_t m, int64_t heads, int64_t kv_heads, int64_t map_kind,
                                       double eps) {
  const bool elu = map_kind == static_cast<int64_t>(MapKind::kElu);
  TORCH_CHECK(static_cast<int64_t>(states.size()) == kStatePerBlock * blocks &&
                  static_cast<int64_t>(mixes.size()) == blocks &&
                  static_cast<int64_t>(maps.size()) == (elu ? 0 : 2 * blocks),
              kStepOp, ": per block 4 states (ring_k, ring_v, s, z), a mix and ", elu ? "no" : "2", " map tensors for ",
              blocks, " blocks, got ", states.size(), ", ", mixes.size(), " and ", maps.size());
  std::vector<HybridLayer> layers;
  for (int64_t l = 0; l < blocks; ++l) {
    const at::Tensor* state = &states[kStatePerBlock * l];
    const c10::optional<at::Tensor> weight = elu ? c10::nullopt : c10::optional<at::Tensor>(maps[2 * l]);
    const c10::optional<at::Tensor> bias = elu ? c10::nullopt : c10::optional<at::Tensor>(maps[2 * l + 1]);
    layers.push_back(hybrid_layer(state[0], state[1], state[2], state[3], mixes[l], weight, bias, map_kind, m, heads,
                                  eps, kStepOp));
    TORCH_CHECK(layers.back().kv == kv_heads, kStepOp, ": block ", l, "'s state has ", layers.back().kv,
                " key heads, the model ", kv_heads);
  }
  return layers;
}

}  // namespace

// tokens (B,) at positions lengths (B,) -> logits (B, N), or the final layer norm's output (B, C) when no head is
// given; every block's state and the lengths move on in place. weights: as linear_decode_step's, the fused q/k/v
// product mapping C -> (H + 2 KV) D; states: per block [ring_k, ring_v, s, z] as hybrid_decode_attention's;
// mixes: per block the mix (H,); maps: per block the map's weight (KV, P, D) and bias (KV, P), none for elu + 1.
torch::Tensor hybrid_decode_step(const torch::Tensor& tokens, const torch::Tensor& lengths,
                                 const torch::Tensor& tok_emb, const torch::Tensor& pos_emb, at::TensorList weights,
                                 at::TensorList states, at::TensorList mixes, at::TensorList maps, int64_t heads,
                                 int64_t kv_heads, int64_t map_kind, double ln_eps, double eps) {
  const int64_t m = tokens.numel(), c = tok_emb.size(1), blocks = mixes.size();
  TORCH_CHECK(heads > 0 && kv_heads > 0 && c % heads == 0 && heads % kv_heads == 0, kStepOp, ": ", heads,
              " query heads over ", kv_heads, " key heads in a width of ", c);
  check_tokens(tokens, lengths, tok_emb, pos_emb, m, kStepOp);
  const int64_t d = c / heads, qkv_width = (heads + 2 * kv_heads) * d;
  // Every input checked before anything is written: a refused call leaves the state as it was.
  const StepWeights checked = step_weights(weights, blocks, c, qkv_width, kStepOp);
  const std::vector<HybridLayer> layers =
      hybrid_layers(states, mixes, maps, blocks, m, heads, kv_heads, map_kind, eps);
  const int64_t* positions = lengths.data_ptr<int64_t>();  // the new tokens': run_step moves them on at its end
  return run_step(tokens, lengths, tok_emb, pos_emb, checked, ln_eps, [&](int64_t l, const float* qkv, float* y) {
    const NewTokens t{qkv, qkv + heads * d, qkv + (heads + kv_heads) * d, qkv_width, d, qkv_width, d, qkv_width, d};
    attend_rows(layers[l], t, positions, m, y);
  });
}

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "hybrid_decode_step(Tensor tokens, Tensor(a!) lengths, Tensor tok_emb, Tensor pos_emb, Tensor[] weights, "
      "Tensor(b!)[] states, Tensor[] mixes, Tensor[] maps, int heads, int kv_heads, int map_kind, float ln_eps, "
      "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(rnnserve, CPU, m) { m.impl("hybrid_decode_step", &hybrid_decode_step); }
