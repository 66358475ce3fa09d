// A linear layer for decode steps on the CPU: out = x W^T + b for a few dozen rows, float32.
//
// Why a kernel: a decode step's products are small (64 rows by 128-512 columns), where MKL's sgemm runs its
// AVX2 code on AMD CPUs and oneDNN's AVX-512 one pays a fixed cost per call before any arithmetic (17 calls a
// step; benchmarks/README.md has the figures). W is packed once into panels of one vector of output columns,
// P[N / L][K][L] (L = 16 floats with AVX-512, 8 with AVX2 or the generic route, 1 in scalar code; zeros past N),
// so a block of up to kRows rows (as many as the route's registers hold accumulators for) by two
// panels keeps its accumulators in registers and reads each panel once per block. Built by model/cpu_kernels.py,
// with the flags of the route it picks (RNNSERVE_CPU_ROUTE forces one).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

// Raw vector types, not at::vec::Vectorized: GCC keeps a 2-D array of these in registers, which it did not do
// for Vectorized's (three times slower here).
#if defined(RNNSERVE_GENERIC_VECTORS)
// The compiler's vector extensions: any GCC or Clang target (NEON on ARM, SSE or AVX on x86) builds them.
using V = float __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
constexpr int64_t kRows = 4;  // 4 x 2 accumulators of two 128-bit registers each where vectors are that wide
inline V vload(const float* p) { V v; __builtin_memcpy(&v, p, sizeof(V)); return v; }
inline void vstore(float* p, V v) { __builtin_memcpy(p, &v, sizeof(V)); }
inline V vbroadcast(float x) { return V{} + x; }
inline V vfma(V a, V b, V c) { return a * b + c; }  // fused where the target has FMA (-ffp-contract=fast)
#elif defined(CPU_CAPABILITY_AVX512)
using V = __m512;
constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 8;  // 8 x 2 accumulators, 2 panel vectors and a broadcast: 19 of the 32 registers
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vbroadcast(float x) { return _mm512_set1_ps(x); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(CPU_CAPABILITY_AVX2)
using V = __m256;
constexpr int64_t kLanes = 8;
constexpr int64_t kRows = 6;  // 6 x 2 accumulators, 2 panel vectors and a broadcast: 15 of the 16 registers
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vbroadcast(float x) { return _mm256_set1_ps(x); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
#else
using V = float;
constexpr int64_t kLanes = 1;
constexpr int64_t kRows = 8;
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V v) { *p = v; }
inline V vbroadcast(float x) { return x; }
inline V vfma(V a, V b, V c) { return a * b + c; }
#endif

struct Problem {
  const float* x;  // (M, K)
  const float* panels;  // (N / L, K, L)
  const float* bias;  // (N,) or nullptr
  float* out;  // (M, N)
  int64_t k, n;
};

// The first `left` of a vector's lanes at p (left < kLanes: the last panel's columns past N are not there).
V load_part(const float* p, int64_t left) {
  alignas(64) float lanes[kLanes] = {};
  std::memcpy(lanes, p, left * sizeof(float));
  return vload(lanes);
}

void store_part(float* p, V v, int64_t left) {
  alignas(64) float lanes[kLanes];
  vstore(lanes, v);
  std::memcpy(p, lanes, left * sizeof(float));
}

// Columns [col, col + P * L) of rows [row, row + R).
template <int R, int P>
void block(const Problem& p, int64_t row, int64_t col) {
  V acc[R][P];
  for (int j = 0; j < P; ++j) {
    const int64_t at = col + j * kLanes, left = std::min<int64_t>(kLanes, p.n - at);
    const V start = !p.bias ? vbroadcast(0.f) : left == kLanes ? vload(p.bias + at) : load_part(p.bias + at, left);
    for (int r = 0; r < R; ++r) acc[r][j] = start;
  }
  const float* x = p.x + row * p.k;
  const float* panel = p.panels + (col / kLanes) * p.k * kLanes;
  for (int64_t k = 0; k < p.k; ++k) {
    V w[P];
    for (int j = 0; j < P; ++j) w[j] = vload(panel + (j * p.k + k) * kLanes);
    for (int r = 0; r < R; ++r) {
      const V xr = vbroadcast(x[r * p.k + k]);
      for (int j = 0; j < P; ++j) acc[r][j] = vfma(xr, w[j], acc[r][j]);
    }
  }
  for (int j = 0; j < P; ++j) {
    const int64_t at = col + j * kLanes, left = std::min<int64_t>(kLanes, p.n - at);
    for (int r = 0; r < R; ++r) {
      float* out = p.out + (row + r) * p.n + at;
      if (left == kLanes) vstore(out, acc[r][j]);
      else store_part(out, acc[r][j], left);
    }
  }
}

template <int P>
void rows_block(const Problem& p, int64_t row, int64_t rows, int64_t col) {
  switch (rows) {
    case 8: return block<8, P>(p, row, col);
    case 7: return block<7, P>(p, row, col);
    case 6: return block<6, P>(p, row, col);
    case 5: return block<5, P>(p, row, col);
    case 4: return block<4, P>(p, row, col);
    case 3: return block<3, P>(p, row, col);
    case 2: return block<2, P>(p, row, col);
    default: return block<1, P>(p, row, col);
  }
}

}  // namespace

// W (N, K) -> P (ceil(N / L), K, L), L this build's vector width in floats.
torch::Tensor pack_linear_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat && weight.device().is_cpu(),
              "pack_linear_weight: a 2-D float32 CPU weight (out_features, in_features), got ", weight.sizes(), " ",
              weight.scalar_type());
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), count = (n + kLanes - 1) / kLanes;
  auto packed = torch::zeros({count, k, kLanes}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  for (int64_t o = 0; o < n; ++o)
    for (int64_t i = 0; i < k; ++i) dst[((o / kLanes) * k + i) * kLanes + o % kLanes] = src[o * k + i];
  return packed;
}

// x (..., K) -> (..., N): x W^T + bias, W given packed by pack_linear_weight.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                            int64_t n) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && packed.scalar_type() == torch::kFloat && packed.dim() == 3 &&
                  packed.size(2) == kLanes && packed.size(0) * kLanes >= n && x.size(-1) == packed.size(1),
              "packed_linear: float32 x (..., K) and weights packed by pack_linear_weight in this build");
  TORCH_CHECK(x.device().is_cpu() && (!bias.has_value() || (bias->scalar_type() == torch::kFloat && bias->numel() == n)),
              "packed_linear: a CPU x and a float32 bias of ", n, " numbers");
  const auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, xc.options());
  const int64_t k = packed.size(1), m = k ? xc.numel() / k : 0;
  const auto b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const Problem p{xc.data_ptr<float>(), packed.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                  out.data_ptr<float>(), k, n};
  const int64_t blocks = (m + kRows - 1) / kRows;
  // Column blocks split over torch's intra-op threads (one thread, as the server runs: a plain loop).
  at::parallel_for(0, (n + 2 * kLanes - 1) / (2 * kLanes), 1, [&](int64_t first, int64_t last) {
    for (int64_t col = first * 2 * kLanes; col < std::min(n, last * 2 * kLanes); col += 2 * kLanes) {
      // Row blocks as even as they go: a short last block (2 of 32 rows in blocks of 6) has too few
      // accumulators to hide the FMAs' latency, and would run at a fraction of the others' rate.
      for (int64_t b = 0, row = 0; b < blocks; ++b) {
        const int64_t rows = m / blocks + (b < m % blocks);
        if (col + kLanes < n) rows_block<2>(p, row, rows, col);
        else rows_block<1>(p, row, rows, col);
        row += rows;
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(rnnserve, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}
