// The unfiltered draw of model/decode/sampling.py (`draw_unfiltered`) in C++: per row, the temperature, the row's
// counter-based point (a hash of its seed and position), the inverse CDF over whole units of 2^-24 summed as
// integers, or the argmax where the temperature is 0. Alone (`categorical_draw`), or right after a linear model's
// one-call step inside the same call (`linear_decode_step_draw`), so that a token costs one operator call.
//
// Why: after a one-call step the draw was the most of what a token cost beyond the step (a compiled graph's call
// and its wrapper, the inputs' layout checks, allocations), and every operation between two steps runs with caches
// the step's weights have just evicted. The draws are the eager ones token for token: the same hash in 32-bit
// unsigned arithmetic, the same float division and the same exponential (ATen's vectorised one, which PyTorch's
// exp and inductor's loops call), truncated and summed as integers; a draw can only move where an exponential's
// last bit differs from PyTorch's scalar one on a row's point exactly at a boundary between tokens.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int kPointBits = 23;   // sampling.py's POINT_BITS
constexpr int kWeightBits = 24;  // sampling.py's WEIGHT_BITS
constexpr float kMinTemperature = 1e-5f;  // sampling.py's scaled_by_temperature clamp

uint32_t hash32(uint32_t x) {  // Wellons' lowbias32, as sampling.py's _hash32
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// sampling.py's row_points: where in [0, 2^23) a row's draw falls, from all 64 bits of its seed and the low 32 of
// its position.
int64_t row_point(int64_t seed, int64_t position) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t of_seed = hash32(hash32(static_cast<uint32_t>(s)) ^ static_cast<uint32_t>(s >> 32));
  const uint32_t key = hash32(of_seed + static_cast<uint32_t>(position) * 0x9E3779B9u);
  return key >> (32 - kPointBits);
}

// sampling.py's fraction_of: floor(total * point / 2^23) without a product past 2^63.
int64_t fraction_of(int64_t total, int64_t point) {
  const int64_t high = total >> kPointBits, low = total & ((int64_t{1} << kPointBits) - 1);
  return high * point + ((low * point) >> kPointBits);
}

// torch.argmax of a row: the first largest value, a NaN counting as larger than any number.
int64_t argmax(const float* x, int64_t v) {
  int64_t best = 0;
  for (int64_t j = 1; j < v; ++j) {
    if (std::isnan(x[best])) break;
    if (x[j] > x[best] || std::isnan(x[j])) best = j;
  }
  return best;
}

// One row's inverse-CDF draw at temperature t > 0. scaled: room for v floats; weights: for v int32.
int64_t inverse_cdf(const float* x, int64_t v, float t, int64_t point, float* scaled, int32_t* weights) {
  float most = -INFINITY;
  for (int64_t j = 0; j < v; ++j) {  // the same division as PyTorch's, lane for lane
    scaled[j] = x[j] / t;
    most = std::isnan(scaled[j]) || scaled[j] > most ? scaled[j] : most;
  }
  const Vec top(most), unit(static_cast<float>(1 << kWeightBits));
  int64_t total = 0;
  for (int64_t j = 0; j < v; j += Vec::size()) {  // the vectorised exp on every lane, the last vector's too
    const int64_t count = std::min<int64_t>(Vec::size(), v - j);
    ((Vec::loadu(scaled + j, count) - top).exp() * unit).store(scaled + j, count);
    for (int64_t i = j; i < j + count; ++i) total += weights[i] = static_cast<int32_t>(scaled[i]);
  }
  // The number of running sums at or below the row's target (sampling.py's count): the first that passes it.
  const int64_t target = fraction_of(total, point);
  int64_t sum = 0;
  for (int64_t j = 0; j < v; ++j) {
    sum += weights[j];
    if (sum > target) return j;
  }
  return v;  // a row of NaNs: as the eager count, past the vocabulary
}

// One temperature, seed, position and drawn token per row of m: checked before anything is written.
void check_rows(const torch::Tensor& temperature, const torch::Tensor& seed, const torch::Tensor& position,
                const torch::Tensor& drawn, int64_t m, const char* op) {
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat && seed.scalar_type() == torch::kLong &&
                  position.scalar_type() == torch::kLong && drawn.scalar_type() == torch::kLong,
              op, ": float32 temperatures, int64 seeds, positions and drawn tokens, got ", temperature.scalar_type(),
              ", ", seed.scalar_type(), ", ", position.scalar_type(), " and ", drawn.scalar_type());
  for (const torch::Tensor* t : {&temperature, &seed, &position, &drawn})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == m, op, ": one temperature, seed, position and drawn token per row of ",
                "the ", m, " rows, got ", t->sizes());
}

void check_logits(const torch::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.size(1) > 0,
              "categorical_draw: logits must be float32 (rows, vocabulary) with unit stride along the vocabulary, got ",
              logits.scalar_type(), " ", logits.sizes(), " strides ", logits.strides());
}

}  // namespace

// Each row's token drawn from softmax(logits / temperature) (sampling.py's draw_unfiltered), written to `drawn`:
// logits (B, V) float32 with unit stride along V; temperature (B,) float32 (0: the argmax), seed and position
// (B,) int64; drawn (B,) int64, any stride (a column of a generation's tokens).
void categorical_draw(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& seed,
                      const torch::Tensor& position, torch::Tensor& drawn) {
  check_logits(logits);
  check_rows(temperature, seed, position, drawn, logits.size(0), "categorical_draw");
  const int64_t m = logits.size(0), v = logits.size(1);
  const auto temperatures = temperature.accessor<float, 1>();
  const auto seeds = seed.accessor<int64_t, 1>(), positions = position.accessor<int64_t, 1>();
  auto out = drawn.accessor<int64_t, 1>();
  const float* rows = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  // Rows apart on torch's threads, a few dozen a task: one row is too little work for a task of its own.
  at::parallel_for(0, m, 32, [&](int64_t first, int64_t last) {
    std::vector<float> scaled(v);
    std::vector<int32_t> weights(v);
    for (int64_t r = first; r < last; ++r) {
      const float* x = rows + r * row_stride;
      const float t = temperatures[r];
      out[r] = t > 0 ? inverse_cdf(x, v, std::max(t, kMinTemperature), row_point(seeds[r], positions[r]),
                                   scaled.data(), weights.data())
                     : argmax(x, v);
    }
  });
}

// linear_step.cpp's step (declared here, defined there: one library).
torch::Tensor linear_decode_step(const torch::Tensor& tokens, const torch::Tensor& lengths, const torch::Tensor& tok_emb,
                                 const torch::Tensor& pos_emb, at::TensorList weights, at::TensorList states,
                                 int64_t heads, double ln_eps, double attn_eps);

// linear_decode_step, then each row's next token drawn from the logits it returns, as categorical_draw draws it:
// a token of a generation in one call. The draw's inputs are checked before the step moves the state on.
torch::Tensor linear_decode_step_draw(const torch::Tensor& tokens, const torch::Tensor& lengths,
                                      const torch::Tensor& tok_emb, const torch::Tensor& pos_emb,
                                      at::TensorList weights, at::TensorList states, int64_t heads, double ln_eps,
                                      double attn_eps, const torch::Tensor& temperature, const torch::Tensor& seed,
                                      const torch::Tensor& position, torch::Tensor& drawn) {
  check_rows(temperature, seed, position, drawn, tokens.numel(), "linear_decode_step_draw");
  auto logits = linear_decode_step(tokens, lengths, tok_emb, pos_emb, weights, states, heads, ln_eps, attn_eps);
  categorical_draw(logits, temperature, seed, position, drawn);
  return logits;
}

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("categorical_draw(Tensor logits, Tensor temperature, Tensor seed, Tensor position, Tensor(a!) drawn) -> ()");
  m.def(
      "linear_decode_step_draw(Tensor tokens, Tensor(a!) lengths, Tensor tok_emb, Tensor pos_emb, Tensor[] weights, "
      "Tensor(b!)[] states, int heads, float ln_eps, float attn_eps, Tensor temperature, Tensor seed, "
      "Tensor position, Tensor(c!) drawn) -> Tensor");
}

TORCH_LIBRARY_IMPL(rnnserve, CPU, m) {
  m.impl("categorical_draw", &categorical_draw);
  m.impl("linear_decode_step_draw", &linear_decode_step_draw);
}
