// A hybrid-attention decode step of one layer (model/attention/hybrid.py, `_step`) as one operator call: every row
// and key head of model/kernels/hybrid_attention.h, on q, k and v as the layer's projection leaves them.
//
// Why a kernel: in PyTorch the step is many small operators per layer (gathers, scatters, a batched
// product per term, the feature map's), each a pass over a batch's state and a dispatch. Built by
// model/kernels/loader.py.
#include <torch/extension.h>

#include "hybrid_attention.h"

namespace {

constexpr const char* kOp = "hybrid_decode_attention";

// A vector (B, N, 1, D) whose last dimension is contiguous: q, k or v as the projection's split leaves them.
void check_one_token(const at::Tensor& t, int64_t b, int64_t d, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 4 && t.size(0) == b && t.size(2) == 1 && t.size(3) == d &&
                  t.stride(3) == 1,
              kOp, ": ", what, " must be float32 (B, heads, 1, D) = (", b, ", heads, 1, ", d,
              ") with contiguous heads, got ", t.sizes(), " strides ", t.strides());
}

// The new tokens' q (B, H, 1, D), k and v (B, KV, 1, D) and their positions start (B,), for a ring of (B, KV, W, D).
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& start,
                  const at::Tensor& ring_k) {
  TORCH_CHECK(ring_k.dim() == 4, kOp, ": the ring must be (B, KV, W, D), got ", ring_k.sizes());
  const int64_t b = ring_k.size(0), kv = ring_k.size(1), d = ring_k.size(3);
  check_one_token(q, b, d, "q");
  check_one_token(k, b, d, "k");
  check_one_token(v, b, d, "v");
  TORCH_CHECK(k.size(1) == kv && v.size(1) == kv && q.size(1) % kv == 0, kOp, ": ", q.size(1), " query heads over ",
              kv, " key heads (k ", k.sizes(), ", v ", v.sizes(), ")");
  TORCH_CHECK(start.scalar_type() == at::kLong && start.dim() == 1 && start.numel() == b,
              kOp, ": start must be int64 (B,) = (", b, "), got ", start.sizes());
  const int64_t* pos = start.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) TORCH_CHECK(pos[r] >= 0, kOp, ": row ", r, " is at position ", pos[r]);
}

}  // namespace

// Whether this build's step takes heads of d numbers, a map of `projected` outputs (0: elu + 1) and a window.
bool hybrid_step_takes(int64_t d, int64_t projected, int64_t window) { return sizes_taken(d, projected, window); }

// q (B, H, 1, D), k and v (B, KV, 1, D) float32 at positions `start` (B,) int64; the state's ring_k, ring_v
// (B, KV, W, D), s (B, KV, F, D) and z (B, KV, F) move on in place; mix (H,) the per-head mix before the sigmoid;
// map_kind 0 elu + 1, 1 t2r, 2 Hedgehog (with map_weight (KV, P, D) and map_bias (KV, P)). Returns (B, H, 1, D).
at::Tensor hybrid_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& start, const at::Tensor& ring_k, const at::Tensor& ring_v,
                                   const at::Tensor& s, const at::Tensor& z, const at::Tensor& mix,
                                   const c10::optional<at::Tensor>& map_weight,
                                   const c10::optional<at::Tensor>& map_bias, int64_t map_kind, double eps) {
  const at::Tensor positions = start.contiguous();
  check_inputs(q, k, v, positions, ring_k);
  const int64_t b = ring_k.size(0), heads = q.size(1);
  // Every input checked before anything is written: a refused call leaves the state as it was.
  const HybridLayer layer = hybrid_layer(ring_k, ring_v, s, z, mix, map_weight, map_bias, map_kind, b, heads, eps, kOp);
  at::Tensor out = at::empty({b, heads, 1, layer.shape.d}, q.options());
  const NewTokens tokens{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), q.stride(0), q.stride(1),
                         k.stride(0),         k.stride(1),         v.stride(0),         v.stride(1)};
  attend_rows(layer, tokens, positions.data_ptr<int64_t>(), b, out.data_ptr<float>());
  return out;
}

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("hybrid_step_takes(int d, int projected, int window) -> bool", &hybrid_step_takes);
  m.def(
      "hybrid_decode_attention(Tensor q, Tensor k, Tensor v, Tensor start, Tensor(a!) ring_k, Tensor(b!) ring_v, "
      "Tensor(c!) s, Tensor(d!) z, Tensor mix, Tensor? map_weight, Tensor? map_bias, int map_kind, float eps) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(rnnserve, CPU, m) { m.impl("hybrid_decode_attention", &hybrid_decode_attention); }
