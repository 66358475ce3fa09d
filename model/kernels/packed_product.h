// out = x W^T + b for a few dozen rows, float32, on W packed into panels (model/kernels/packed_linear.cpp packs
// it and is the operator; model/kernels/linear_step.cpp runs it inside a whole decode step).
//
// W is packed once into panels of one vector of output columns, P[N / L][K][L] (L = kLanes; zeros past N), so a
// block of up to kRows rows (as many as the route's registers hold accumulators for) by two panels keeps its
// accumulators in registers and reads each panel once per block. What happens to a block's sums on their way
// out (`Epilogue`) is done there, while they are in registers: GELU, or adding them to what `out` holds (a
// residual).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>

#include "vectors.h"

namespace {

enum class Epilogue { kStore, kGelu, kAccumulate };

struct Problem {
  const float* x;  // (M, K)
  const float* panels;  // (N / L, K, L)
  const float* bias;  // (N,) or nullptr
  float* out;  // (M, N)
  int64_t m, k, n;
  Epilogue epilogue = Epilogue::kStore;
};

inline V finish(const Problem& p, V sums, const float* out, int64_t left) {
  switch (p.epilogue) {
    case Epilogue::kGelu: return gelu(sums);
    case Epilogue::kAccumulate: return sums + (left == kLanes ? vload(out) : load_part(out, left));
    default: return sums;
  }
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
      const V v = finish(p, acc[r][j], out, left);
      if (left == kLanes) vstore(out, v);
      else store_part(out, v, left);
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

// The whole product, its column blocks split over torch's intra-op threads (one thread, as the server runs:
// a plain loop).
inline void packed_product(const Problem& p) {
  const int64_t blocks = (p.m + kRows - 1) / kRows;
  at::parallel_for(0, (p.n + 2 * kLanes - 1) / (2 * kLanes), 1, [&](int64_t first, int64_t last) {
    for (int64_t col = first * 2 * kLanes; col < std::min(p.n, last * 2 * kLanes); col += 2 * kLanes) {
      // Row blocks as even as they go: a short last block (2 of 32 rows in blocks of 6) has too few
      // accumulators to hide the FMAs' latency, and would run at a fraction of the others' rate.
      for (int64_t b = 0, row = 0; b < blocks; ++b) {
        const int64_t rows = p.m / blocks + (b < p.m % blocks);
        if (col + kLanes < p.n) rows_block<2>(p, row, rows, col);
        else rows_block<1>(p, row, rows, col);
        row += rows;
      }
    }
  });
}

}  // namespace
