// out = x W^T + b for a few rows in bfloat16: x, W and out bfloat16, the sums float32 (as PyTorch's bfloat16
// linear accumulates), rounded to bfloat16 once, to nearest even, on the way out. model/kernels/packed_linear.cpp
// packs W and is the operator.
//
// Why a kernel of its own: at a decode step's few rows the product reads each weight once, so its time is the
// weight's bytes; bfloat16 panels are half the float32 ones. W is packed once into panels of one vector of output
// columns whose lanes each hold a pair of consecutive inputs, P[N / L][K / 2][L] (a 32-bit word per lane: input
// 2i in its low half, 2i + 1 in its high half; zeros past N and past an odd K). That is the layout AVX512_BF16's
// pairwise dot product (vdpbf16ps) reads, used where the CPU has it; the other routes widen a word's two halves
// to float32 in registers (a bfloat16 is a float32's high half) and multiply-add them as the float32 kernel does.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

#include "vectors.h"

namespace {

struct Bf16Problem {
  const uint32_t* x;  // (M, K / 2): pairs of bfloat16 inputs (the vdpbf16ps route)
  const float* wide_x;  // (M, K / 2 * 2): the inputs widened to float32 (the other routes)
  const uint32_t* panels;  // (N / L, K / 2, L)
  const float* bias;  // (N,) widened to float32, or nullptr
  c10::BFloat16* out;  // (M, N)
  int64_t m, pairs, n;
};

#if defined(RNNSERVE_AVX512_BF16)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// Lanes' words as vectors of both their halves widened: input 2i (low half) and 2i + 1 (high half).
inline VI load_words(const uint32_t* p) {
  VI words;
  std::memcpy(&words, p, sizeof(VI));
  return words;
}
inline V low_halves(VI words) { return from_bits(words << 16); }
inline V high_halves(VI words) { return from_bits(words & static_cast<int32_t>(0xffff0000u)); }

// Columns [col, col + P * L) of rows [row, row + R).
template <int R, int P>
void bf16_block(const Bf16Problem& p, int64_t row, int64_t col) {
  V acc[R][P];
  for (int j = 0; j < P; ++j) {
    const int64_t at = col + j * kLanes, left = std::min<int64_t>(kLanes, p.n - at);
    const V start = !p.bias ? vbroadcast(0.f) : left == kLanes ? vload(p.bias + at) : load_part(p.bias + at, left);
    for (int r = 0; r < R; ++r) acc[r][j] = start;
  }
  const uint32_t* panel = p.panels + (col / kLanes) * p.pairs * kLanes;
  for (int64_t i = 0; i < p.pairs; ++i) {
#if defined(RNNSERVE_AVX512_BF16)
    __m512bh w[P];
    for (int j = 0; j < P; ++j) w[j] = (__m512bh)_mm512_loadu_si512(panel + (j * p.pairs + i) * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(p.x[(row + r) * p.pairs + i]));
      for (int j = 0; j < P; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xr, w[j]);
    }
#else
    for (int j = 0; j < P; ++j) {
      const VI words = load_words(panel + (j * p.pairs + i) * kLanes);
      const V even = low_halves(words), odd = high_halves(words);
      for (int r = 0; r < R; ++r) {
        const float* x = p.wide_x + (row + r) * 2 * p.pairs + 2 * i;
        acc[r][j] = vfma(vbroadcast(x[1]), odd, vfma(vbroadcast(x[0]), even, acc[r][j]));
      }
    }
#endif
  }
  for (int j = 0; j < P; ++j) {
    const int64_t at = col + j * kLanes, left = std::min<int64_t>(kLanes, p.n - at);
    for (int r = 0; r < R; ++r) {
      alignas(64) float sums[kLanes];
      vstore(sums, acc[r][j]);
      c10::BFloat16* out = p.out + (row + r) * p.n + at;
      for (int64_t c = 0; c < left; ++c) out[c] = c10::BFloat16(sums[c]);  // to nearest even, as torch rounds
    }
  }
}

template <int P>
void bf16_rows_block(const Bf16Problem& p, int64_t row, int64_t rows, int64_t col) {
  switch (rows) {
    case 8: return bf16_block<8, P>(p, row, col);
    case 7: return bf16_block<7, P>(p, row, col);
    case 6: return bf16_block<6, P>(p, row, col);
    case 5: return bf16_block<5, P>(p, row, col);
    case 4: return bf16_block<4, P>(p, row, col);
    case 3: return bf16_block<3, P>(p, row, col);
    case 2: return bf16_block<2, P>(p, row, col);
    default: return bf16_block<1, P>(p, row, col);
  }
}

// The whole product, its column blocks split over torch's intra-op threads, its rows in blocks as even as they go
// (packed_product.h says why).
inline void packed_product_bf16(const Bf16Problem& p) {
  const int64_t blocks = (p.m + kRows - 1) / kRows;
  at::parallel_for(0, (p.n + 2 * kLanes - 1) / (2 * kLanes), 1, [&](int64_t first, int64_t last) {
    for (int64_t col = first * 2 * kLanes; col < std::min(p.n, last * 2 * kLanes); col += 2 * kLanes) {
      for (int64_t b = 0, row = 0; b < blocks; ++b) {
        const int64_t rows = p.m / blocks + (b < p.m % blocks);
        if (col + kLanes < p.n) bf16_rows_block<2>(p, row, rows, col);
        else bf16_rows_block<1>(p, row, rows, col);
        row += rows;
      }
    }
  });
}

}  // namespace
