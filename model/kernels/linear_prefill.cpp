// Causal linear attention over a chunk of tokens as a recurrence, from and into a row's state: the prefill of a
// prompt on the CPU.
//
// Why a kernel: the parallel (chunked) form in model/attention/linear.py materialises (C, C) score blocks and
// per-block (F, D) sums for every row and head, many times the bytes of the inputs, which a server's prefill
// spends more time on than on its matrix products. Here each row and head keeps its sums [S | Z] (F by D + 1
// numbers, a few KiB) in L1 while it walks the chunk: per token one rank-1 update and one read, 4 F (D + 1) FLOPs,
// the same order of operations as a decode step (update with the token, then read it back), reading each input
// once. Rows and heads split over torch's intra-op threads. The loops over D are plain C++ that the compiler
// vectorises with the route's flags (model/kernels/loader.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {

struct Chunk {
  const float* q;  // (G, T, F), G = B * H, feature-mapped
  const float* k;  // (G, T, F), feature-mapped
  const float* v;  // (G, T, D)
  float* state;  // (G, D + 1, F): [S | Z]^T, updated in place
  float* y;  // (G, T, D)
  int64_t t, f, d;
  float eps;
};

// One row and head: its state in (F, D + 1) order, so that both the update (row i += k_i [v; 1]) and the read
// (sum over i of q_i row i) run along contiguous memory; `sums` and `read` are scratch of F (D + 1) and D + 1.
void scan(const Chunk& c, int64_t g, float* __restrict sums, float* __restrict read) {
  const int64_t e = c.d + 1;
  float* state = c.state + g * e * c.f;
  for (int64_t j = 0; j < e; ++j)
    for (int64_t i = 0; i < c.f; ++i) sums[i * e + j] = state[j * c.f + i];
  for (int64_t n = 0; n < c.t; ++n) {
    const float* q = c.q + (g * c.t + n) * c.f;
    const float* k = c.k + (g * c.t + n) * c.f;
    const float* __restrict v = c.v + (g * c.t + n) * c.d;
    for (int64_t j = 0; j < e; ++j) read[j] = 0.f;
    for (int64_t i = 0; i < c.f; ++i) {
      float* __restrict row = sums + i * e;
      const float ki = k[i], qi = q[i];
      for (int64_t j = 0; j < c.d; ++j) {
        row[j] += ki * v[j];
        read[j] += qi * row[j];
      }
      row[c.d] += ki;
      read[c.d] += qi * row[c.d];
    }
    float* y = c.y + (g * c.t + n) * c.d;
    const float denominator = read[c.d] + c.eps;
    for (int64_t j = 0; j < c.d; ++j) y[j] = read[j] / denominator;
  }
  for (int64_t j = 0; j < e; ++j)
    for (int64_t i = 0; i < c.f; ++i) state[j * c.f + i] = sums[i * e + j];
}

}  // namespace

// q, k (B, H, T, F) feature-mapped, v (B, H, T, D), state (B, H, D + 1, F) updated in place -> y (B, H, T, D):
// y_t = phi(q_t)^T S_t / (phi(q_t)^T Z_t + eps), with S_t, Z_t the sums up to and including token t.
torch::Tensor linear_attention_prefill(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       torch::Tensor state, double eps) {
  for (const torch::Tensor* x : {&q, &k, &v, static_cast<const torch::Tensor*>(&state)})
    TORCH_CHECK(x->dim() == 4 && x->scalar_type() == torch::kFloat && x->device().is_cpu() && x->is_contiguous(),
                "linear_attention_prefill: contiguous 4-D float32 CPU tensors, got ", x->sizes(), " ",
                x->scalar_type());
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), f = q.size(3), d = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == b && v.size(1) == h && v.size(2) == t &&
                  state.sizes() == torch::IntArrayRef({b, h, d + 1, f}),
              "linear_attention_prefill: q, k (B, H, T, F), v (B, H, T, D) and state (B, H, D + 1, F), got ",
              q.sizes(), k.sizes(), v.sizes(), state.sizes());
  auto y = torch::empty_like(v);
  const Chunk c{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), state.data_ptr<float>(),
                y.data_ptr<float>(), t, f, d, static_cast<float>(eps)};
  at::parallel_for(0, b * h, 1, [&](int64_t first, int64_t last) {
    std::vector<float> sums(f * (d + 1)), read(d + 1);
    for (int64_t g = first; g < last; ++g) scan(c, g, sums.data(), read.data());
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("linear_attention_prefill(Tensor q, Tensor k, Tensor v, Tensor(a!) state, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(rnnserve, CPU, m) { m.impl("linear_attention_prefill", &linear_attention_prefill); }
