// The hybrid attention's decode step for every row and key head of one layer (model/attention/hybrid.py, `_step`):
// the key leaving the window moves from its ring slot into the linear sums S and Z, the new key and value take the
// slot, then each query head of the key head's group attends with exact softmax over the ring and phi(q) over the
// sums, sharing one normaliser mixed by g = sigmoid(mix). Each row's ring and sums are read once while in cache,
// the next key head's asked for meanwhile, and phi (elu + 1, t2r or Hedgehog) is computed in registers, for the
// leaving key and each query. The ring holds float32 numbers or bfloat16 ones (the model's --kv-cache-dtype), widened
// to float32 as they load; the sums are float32 either way, and so is every product. The attention alone is model/kernels/hybrid_decode.cpp's operator; a whole step
// around it, model/kernels/hybrid_step.cpp's.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "vectors.h"

namespace {

constexpr int64_t kMaxHeadDim = 512;  // the longest head kept on the stack
constexpr int64_t kMaxFeatures = 1024;  // the longest phi (and projection) kept on the stack
constexpr int64_t kMaxWindow = 4096;  // the longest window whose scores are kept on the stack

using Bf16 = c10::BFloat16;

// A vector of a ring's numbers as float32: T is float, or bfloat16 widened as it loads.
inline V load_ring(const float* p) { return vload(p); }
inline V load_ring(const Bf16* p) { return vload_bf16(reinterpret_cast<const uint16_t*>(p)); }

// x (n,) into a ring slot; a bfloat16 ring rounds each number to nearest even, as torch's .to() does.
inline void store_ring(const float* x, int64_t n, float* slot) { std::copy(x, x + n, slot); }
inline void store_ring(const float* x, int64_t n, Bf16* slot) {
  for (int64_t i = 0; i < n; ++i) slot[i] = Bf16(x[i]);
}

// A slot's n numbers (a whole number of vectors) as float32: the slot itself for a float32 ring, else widened into
// `buffer`.
template <typename T>
const float* widened(const T* slot, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return slot;
  } else {
    for (int64_t i = 0; i < n; i += kLanes) vstore(buffer + i, load_ring(slot + i));
    return buffer;
  }
}

enum class MapKind : int64_t { kElu = 0, kT2R = 1, kHedgehog = 2 };

// The feature map of one key head: elu + 1 (F = D), or x -> W x + b (P outputs) then relu (F = P) or Hedgehog's
// [softmax(p), softmax(-p)] (F = 2P). `weight_t` is W transposed, (D, P), so that the projection runs along P.
struct FeatureMap {
  MapKind kind;
  const float* weight_t;  // (D, P), or null for elu
  const float* bias;  // (P,), or null for elu
  int64_t d, p;
};

// The largest and smallest of x[0 .. n), n a whole number of vectors: lane-wise, then across the lanes.
float largest(const float* x, int64_t n) {
  V top = vload(x);
  for (int64_t i = kLanes; i < n; i += kLanes) top = vmax(top, vload(x + i));
  return hmax(top);
}

float smallest(const float* x, int64_t n) {
  V bottom = vload(x);
  for (int64_t i = kLanes; i < n; i += kLanes) bottom = vmin(bottom, vload(x + i));
  return hmin(bottom);
}

// projected = W x + b for PC vectors of outputs (PC > 0), into registers. Accumulator chains along D (four for
// up to two vectors of outputs, else two), so that the products do not wait on one another.
template <int PC>
void project_held(const FeatureMap& map, const float* x, V* projected) {
  constexpr int64_t kSets = PC <= 2 ? 4 : 2;
  V sums[kSets][PC];
  for (int64_t c = 0; c < PC; ++c) {
    sums[0][c] = vload(map.bias + c * kLanes);
    for (int64_t a = 1; a < kSets; ++a) sums[a][c] = vbroadcast(0.f);
  }
  for (int64_t j = 0; j < map.d; j += kSets)
    for (int64_t a = 0; a < kSets && j + a < map.d; ++a) {
      const V xj = vbroadcast(x[j + a]);
      const float* line = map.weight_t + (j + a) * map.p;
      for (int64_t c = 0; c < PC; ++c) sums[a][c] = vfma(xj, vload(line + c * kLanes), sums[a][c]);
    }
  for (int64_t c = 0; c < PC; ++c) {
    projected[c] = sums[0][c];
    for (int64_t a = 1; a < kSets; ++a) projected[c] = projected[c] + sums[a][c];
  }
}

// projected = W x + b (P outputs, PC vectors of them; PC = 0: as many as P takes, summed in memory).
template <int PC>
void project(const FeatureMap& map, const float* x, float* projected) {
  if constexpr (PC == 0) {
    for (int64_t i = 0; i < map.p; i += kLanes) vstore(projected + i, vload(map.bias + i));
    for (int64_t j = 0; j < map.d; ++j) {
      const V xj = vbroadcast(x[j]);
      const float* line = map.weight_t + j * map.p;
      for (int64_t i = 0; i < map.p; i += kLanes) vstore(projected + i, vfma(xj, vload(line + i), vload(projected + i)));
    }
  } else {
    V held[PC];
    project_held<PC>(map, x, held);
    for (int64_t c = 0; c < PC; ++c) vstore(projected + c * kLanes, held[c]);
  }
}

// Hedgehog's phi of x for PC vectors of projected outputs, all in registers: [softmax(p), softmax(-p)] into out
// (2P,), as softmax_into computes each half (the same operations in the same order), without a pass through memory.
template <int PC>
void hedgehog_held(const FeatureMap& map, const float* x, float* out) {
  V p[PC];
  project_held<PC>(map, x, p);
  V top = p[0], bottom = p[0];
  for (int64_t c = 1; c < PC; ++c) top = vmax(top, p[c]), bottom = vmin(bottom, p[c]);
  const V high = vbroadcast(hmax(top)), low = vbroadcast(hmin(bottom));
  V up[PC], down[PC], up_sum = vbroadcast(0.f), down_sum = vbroadcast(0.f);
  for (int64_t c = 0; c < PC; ++c) {
    up[c] = exp_of_nonpositive(p[c] - high);
    down[c] = exp_of_nonpositive(p[c] * vbroadcast(-1.f) - low * vbroadcast(-1.f));
    up_sum = up_sum + up[c];
    down_sum = down_sum + down[c];
  }
  const V up_total = vbroadcast(hsum(up_sum)), down_total = vbroadcast(hsum(down_sum));
  for (int64_t c = 0; c < PC; ++c) {
    vstore(out + c * kLanes, up[c] / up_total);
    vstore(out + map.p + c * kLanes, down[c] / down_total);
  }
}

// out[i] = exp(x[i] * sign - top) / sum of them, i < n (n a whole number of vectors; sign * x[i] - top <= 0).
void softmax_into(const float* x, float sign, float top, float* out, int64_t n) {
  V sum = vbroadcast(0.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const V e = exp_of_nonpositive(vload(x + i) * vbroadcast(sign) - vbroadcast(top));
    vstore(out + i, e);
    sum = sum + e;
  }
  const V total = vbroadcast(hsum(sum));
  for (int64_t i = 0; i < n; i += kLanes) vstore(out + i, vload(out + i) / total);
}

// phi(x): x (D,) -> out (F,).
void feature_map(const FeatureMap& map, const float* x, float* out) {
  if (map.kind == MapKind::kElu) {
    for (int64_t i = 0; i < map.d; i += kLanes) vstore(out + i, elu_plus_one(vload(x + i)));
    return;
  }
  if (map.kind == MapKind::kHedgehog) {
    switch (map.p / kLanes) {
      case 1: return hedgehog_held<1>(map, x, out);
      case 2: return hedgehog_held<2>(map, x, out);
      case 4: return hedgehog_held<4>(map, x, out);
      default: break;  // longer projections: through memory, below
    }
  }
  alignas(64) float projected[kMaxFeatures];
  switch (map.p / kLanes) {
    case 1: project<1>(map, x, projected); break;
    case 2: project<2>(map, x, projected); break;
    case 4: project<4>(map, x, projected); break;
    default: project<0>(map, x, projected); break;
  }
  if (map.kind == MapKind::kT2R) {
    for (int64_t i = 0; i < map.p; i += kLanes) vstore(out + i, vmax(vload(projected + i), vbroadcast(0.f)));
    return;
  }
  // softmax(-p) = exp(min(p) - p) / sum: both halves' exponents are at most 0.
  softmax_into(projected, 1.f, largest(projected, map.p), out, map.p);
  softmax_into(projected, -1.f, -smallest(projected, map.p), out + map.p, map.p);
}

float dot(const float* a, const float* b, int64_t n) {
  V sum = vbroadcast(0.f);
  for (int64_t i = 0; i < n; i += kLanes) sum = vfma(vload(a + i), vload(b + i), sum);
  return hsum(sum);
}

// The sizes of a layer, shared by every row and key head.
struct Shape {
  int64_t d, w, f, groups;  // head size, window, features, query heads per key head
  float scale, eps;
};

// One row's one key head: its state, the new key and value at `position`, the group's queries and outputs. T: the
// ring's numbers, float or bfloat16.
template <typename T>
struct KeyHead {
  T *ring_k, *ring_v;  // (W, D) each
  float *s, *z;  // (F, D), (F,)
  const float *k, *v;  // (D,) each
  const float* q;  // the group's first query (D,); the next ones `q_stride` apart
  int64_t q_stride, position;
  const float* gates;  // the group's g = sigmoid(mix), (G,)
  float* out;  // (G, D), contiguous
};

// The state lines of the key head worked on next, asked for from memory while this one computes, since a
// batch's states do not fit in the caches (as softmax_decode.cpp does for its next positions). Null past a
// thread's last key head.
template <typename T>
struct Ahead {
  const T *ring_k, *ring_v;
  const float* s;

  template <typename N>
  void line(const N* base, int64_t at) const {
    if (base) __builtin_prefetch(base + at);
  }
  // The numbers [at, at + n) of one of the next state's arrays, a cache line (64 bytes) at a time.
  template <typename N>
  void lines(const N* base, int64_t at, int64_t n) const {
    for (int64_t i = 0; i < n; i += 64 / static_cast<int64_t>(sizeof(N))) line(base, at + i);
  }
};

// The key written W positions ago leaves the ring slot the new one takes: S += phi(k_old) v_old^T, Z += phi(k_old).
template <typename T>
void move_into_sums(const KeyHead<T>& h, const FeatureMap& map, const Shape& shape, int64_t slot,
                    const Ahead<T>& ahead) {
  T* old_k = h.ring_k + slot * shape.d;
  T* old_v = h.ring_v + slot * shape.d;
  if (h.position >= shape.w) {
    alignas(64) float phi[kMaxFeatures], key_buffer[kMaxHeadDim], value_buffer[kMaxHeadDim];
    feature_map(map, widened(old_k, shape.d, key_buffer), phi);
    const float* value = widened(old_v, shape.d, value_buffer);
    for (int64_t i = 0; i < shape.f; ++i) {
      const V weight = vbroadcast(phi[i]);
      float* line = h.s + i * shape.d;
      ahead.lines(ahead.s, i * shape.d, shape.d);
      for (int64_t c = 0; c < shape.d; c += kLanes) vstore(line + c, vfma(weight, vload(value + c), vload(line + c)));
    }
    for (int64_t i = 0; i < shape.f; i += kLanes) vstore(h.z + i, vload(h.z + i) + vload(phi + i));
  } else {
    ahead.lines(ahead.s, 0, shape.f * shape.d);
  }
  store_ring(h.k, shape.d, old_k);
  store_ring(h.v, shape.d, old_v);
}

// q . key for C vectors a head (C = 0: `chunks` of them), q held in registers.
template <int C, typename T>
float dot_held(const V* q, const T* key, int64_t chunks) {
  const int64_t count = C ? C : chunks;
  V sum = q[0] * load_ring(key);
  for (int64_t c = 1; c < count; ++c) sum = vfma(q[c], load_ring(key + c * kLanes), sum);
  return hsum(sum);
}

// The window's scores of one query, exponentiated: scores[slot] = exp(s - max s) for the first `written` slots,
// 0 up to a whole number of vectors; returns their sum.
template <int C, typename T>
float window_weights(const KeyHead<T>& h, const Shape& shape, const float* q, int64_t written, float* scores,
                     const Ahead<T>& ahead) {
  constexpr int64_t kHeld = C ? C : kMaxHeadDim / kLanes;
  const int64_t d = shape.d, chunks = C ? C : d / kLanes;
  V held[kHeld];
  for (int64_t c = 0; c < chunks; ++c) held[c] = vload(q + c * kLanes);
  for (int64_t slot = 0; slot < written; ++slot) {
    ahead.lines(ahead.ring_k, slot * d, d);
    scores[slot] = dot_held<C>(held, h.ring_k + slot * d, chunks) * shape.scale;
  }
  const int64_t padded = (written + kLanes - 1) / kLanes * kLanes;
  for (int64_t slot = written; slot < padded; ++slot) scores[slot] = scores[0];  // lanes past the ring: no new top
  const float top = largest(scores, padded);
  for (int64_t slot = written; slot < padded; ++slot) scores[slot] = top;  // zeroed below
  for (int64_t slot = 0; slot < padded; slot += kLanes)
    vstore(scores + slot, exp_of_nonpositive(vload(scores + slot) - vbroadcast(top)));
  for (int64_t slot = written; slot < padded; ++slot) scores[slot] = 0.f;
  V sum = vbroadcast(0.f);
  for (int64_t slot = 0; slot < padded; slot += kLanes) sum = sum + vload(scores + slot);
  return hsum(sum);
}

// One query over the ring's first `written` slots and the sums: out = (g sum_w e_w v_w + (1 - g) phi(q)^T S) /
// (g sum_w e_w + (1 - g) phi(q)^T Z + eps), e_w = exp(s_w - max s). C vectors a head, or (C = 0) as many as it
// takes; the weighted sums keep kChains accumulators each, so that their additions do not wait on one another.
template <int C, typename T>
void attend_one(const KeyHead<T>& h, const FeatureMap& map, const Shape& shape, const float* q, float g, float* out,
                int64_t written, const Ahead<T>& ahead) {
  constexpr int64_t kChains = 4;
  constexpr int64_t kHeld = C ? C : kMaxHeadDim / kLanes;
  const int64_t d = shape.d, chunks = C ? C : d / kLanes;
  alignas(64) float scores[kMaxWindow + kLanes];
  const float window_sum = window_weights<C>(h, shape, q, written, scores, ahead);

  alignas(64) float phi[kMaxFeatures];
  feature_map(map, q, phi);
  V window[kChains][kHeld], linear[kChains][kHeld];
  for (int64_t a = 0; a < kChains; ++a)
    for (int64_t c = 0; c < chunks; ++c) window[a][c] = linear[a][c] = vbroadcast(0.f);
  int64_t slot = 0;
  for (; slot + kChains <= written; slot += kChains)
    for (int64_t a = 0; a < kChains; ++a) {
      const V e = vbroadcast(scores[slot + a]);
      const T* value = h.ring_v + (slot + a) * d;
      ahead.lines(ahead.ring_v, (slot + a) * d, d);
      for (int64_t c = 0; c < chunks; ++c) window[a][c] = vfma(e, load_ring(value + c * kLanes), window[a][c]);
    }
  for (; slot < written; ++slot) {
    const V e = vbroadcast(scores[slot]);
    ahead.lines(ahead.ring_v, slot * d, d);
    for (int64_t c = 0; c < chunks; ++c)
      window[0][c] = vfma(e, load_ring(h.ring_v + slot * d + c * kLanes), window[0][c]);
  }
  int64_t i = 0;
  for (; i + kChains <= shape.f; i += kChains)
    for (int64_t a = 0; a < kChains; ++a) {
      const V weight = vbroadcast(phi[i + a]);
      const float* line = h.s + (i + a) * d;
      for (int64_t c = 0; c < chunks; ++c) linear[a][c] = vfma(weight, vload(line + c * kLanes), linear[a][c]);
    }
  for (; i < shape.f; ++i)
    for (int64_t c = 0; c < chunks; ++c)
      linear[0][c] = vfma(vbroadcast(phi[i]), vload(h.s + i * d + c * kLanes), linear[0][c]);
  const float denominator = g * window_sum + (1.f - g) * dot(phi, h.z, shape.f) + shape.eps;
  const V vg = vbroadcast(g), rest = vbroadcast(1.f - g), below = vbroadcast(denominator);
  for (int64_t c = 0; c < chunks; ++c) {
    const V windowed = (window[0][c] + window[1][c]) + (window[2][c] + window[3][c]);
    const V linear_read = (linear[0][c] + linear[1][c]) + (linear[2][c] + linear[3][c]);
    vstore(out + c * kLanes, (vg * windowed + rest * linear_read) / below);
  }
}

template <int C, typename T>
void step_key_head(const KeyHead<T>& h, const FeatureMap& map, const Shape& shape, const Ahead<T>& ahead) {
  move_into_sums(h, map, shape, h.position % shape.w, ahead);
  const int64_t written = std::min(h.position + 1, shape.w);  // slots 0 .. position are written before the ring wraps
  // The group's first query brings the next key head's ring in; the others find this one's in cache.
  for (int64_t i = 0; i < shape.groups; ++i)
    attend_one<C>(h, map, shape, h.q + i * h.q_stride, h.gates[i], h.out + i * shape.d, written,
                  i == 0 ? ahead : Ahead<T>{});
}

template <typename T>
void step_key_head(const KeyHead<T>& h, const FeatureMap& map, const Shape& shape, const Ahead<T>& ahead) {
  switch (shape.d / kLanes) {
    case 1: step_key_head<1>(h, map, shape, ahead); break;
    case 2: step_key_head<2>(h, map, shape, ahead); break;
    case 4: step_key_head<4>(h, map, shape, ahead); break;
    case 8: step_key_head<8>(h, map, shape, ahead); break;
    default: step_key_head<0>(h, map, shape, ahead); break;
  }
}

bool sizes_taken(int64_t d, int64_t projected, int64_t window) {
  const bool head = d > 0 && d % kLanes == 0 && d <= kMaxHeadDim;
  const bool features = projected == 0 || (projected % kLanes == 0 && 2 * projected <= kMaxFeatures);
  return head && features && d <= kMaxFeatures && window > 0 && window <= kMaxWindow;
}

void check_state(const at::Tensor& t, at::IntArrayRef shape, const char* op, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == shape, op, ": ", what,
              " must be a contiguous float32 ", shape, ", got ", t.sizes());
}

// The ring's keys or values: contiguous (B, KV, W, D), float32 or bfloat16 as the other of the pair.
void check_ring(const at::Tensor& t, const at::Tensor& keys, at::IntArrayRef shape, const char* op, const char* what) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.scalar_type() == keys.scalar_type() && t.is_contiguous() && t.sizes() == shape,
              op, ": ", what, " must be a contiguous float32 or bfloat16 ", shape,
              " (both of the ring's halves in one dtype), got ", t.scalar_type(), " ", t.sizes());
}

// One layer's hybrid attention, checked: its state (moved on in place), its map (W transposed, once per call) and
// its gates.
struct HybridLayer {
  void *ring_k, *ring_v;  // (B, KV, W, D) each, float or bfloat16 (`bf16_ring`)
  bool bf16_ring;
  float *s, *z;  // (B, KV, F, D), (B, KV, F)
  int64_t kv;
  Shape shape;
  MapKind kind;
  std::vector<float> weight_t;  // (KV, D, P), empty for elu
  const float* bias;  // (KV, P), or null for elu
  int64_t p;
  at::Tensor gates;  // (H,) sigmoid(mix), as the eager step's torch.sigmoid

  FeatureMap map_of(int64_t j) const {  // key head j's
    if (kind == MapKind::kElu) return {kind, nullptr, nullptr, shape.d, 0};
    return {kind, weight_t.data() + j * shape.d * p, bias + j * p, shape.d, p};
  }
};

// The map's weight (KV, P, D) transposed to (KV, D, P); empty for elu.
std::vector<float> transposed_weights(const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                      MapKind kind, int64_t kv, int64_t d, int64_t f, const char* op) {
  if (kind == MapKind::kElu) {
    TORCH_CHECK(f == d, op, ": elu + 1 features are one per head number (", d, "), the sums hold ", f);
    return {};
  }
  TORCH_CHECK(weight.has_value() && bias.has_value() && weight->defined() && bias->defined(), op,
              ": a t2r or Hedgehog map needs its weight and bias");
  const at::Tensor w = weight->contiguous(), b = *bias;
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 3 && w.size(0) == kv && w.size(2) == d, op,
              ": the map's weight must be float32 (KV, P, D) = (", kv, ", P, ", d, "), got ", w.sizes());
  const int64_t p = w.size(1);
  TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.dim() == 2 && b.size(0) == kv && b.size(1) == p,
              op, ": the map's bias must be a contiguous float32 (KV, P) = (", kv, ", ", p, "), got ", b.sizes());
  TORCH_CHECK(f == (kind == MapKind::kHedgehog ? 2 * p : p), op, ": ", p, " projected features make ",
              kind == MapKind::kHedgehog ? 2 * p : p, " features, the sums hold ", f);
  TORCH_CHECK(sizes_taken(d, p, 1), op, ": ", p, " projected features: this build takes a multiple of ", kLanes,
              " up to ", kMaxFeatures / 2);
  std::vector<float> out(kv * d * p);
  const float* src = w.data_ptr<float>();
  for (int64_t j = 0; j < kv; ++j)
    for (int64_t i = 0; i < p; ++i)
      for (int64_t c = 0; c < d; ++c) out[(j * d + c) * p + i] = src[(j * p + i) * d + c];
  return out;
}

// A layer for b rows of `heads` query heads: every input checked before anything is written, so that a refused
// call leaves the state as it was. map_kind 0 elu + 1, 1 t2r, 2 Hedgehog.
HybridLayer hybrid_layer(const at::Tensor& ring_k, const at::Tensor& ring_v, const at::Tensor& s, const at::Tensor& z,
                         const at::Tensor& mix, const c10::optional<at::Tensor>& map_weight,
                         const c10::optional<at::Tensor>& map_bias, int64_t map_kind, int64_t b, int64_t heads,
                         double eps, const char* op) {
  TORCH_CHECK(ring_k.dim() == 4 && s.dim() == 4, op, ": the ring must be (B, KV, W, D) and S (B, KV, F, D), got ",
              ring_k.sizes(), " and ", s.sizes());
  const int64_t kv = ring_k.size(1), w = ring_k.size(2), d = ring_k.size(3), f = s.size(2);
  check_ring(ring_k, ring_k, {b, kv, w, d}, op, "ring_k");
  check_ring(ring_v, ring_k, {b, kv, w, d}, op, "ring_v");
  check_state(s, {b, kv, f, d}, op, "s");
  check_state(z, {b, kv, f}, op, "z");
  TORCH_CHECK(kv > 0 && heads % kv == 0, op, ": ", heads, " query heads over ", kv, " key heads");
  TORCH_CHECK(sizes_taken(d, 0, w) && f <= kMaxFeatures, op, ": heads of ", d, " numbers and a window of ", w,
              ": this build takes a multiple of ", kLanes, " up to ", kMaxHeadDim, " and up to ", kMaxWindow);
  TORCH_CHECK(mix.scalar_type() == at::kFloat && mix.dim() == 1 && mix.numel() == heads, op,
              ": mix must be float32 (H,) = (", heads, "), got ", mix.sizes());
  TORCH_CHECK(map_kind >= 0 && map_kind <= 2, op, ": map_kind 0 (elu), 1 (t2r) or 2 (Hedgehog), got ", map_kind);
  const MapKind kind = static_cast<MapKind>(map_kind);
  std::vector<float> weight_t = transposed_weights(map_weight, map_bias, kind, kv, d, f, op);
  const bool elu = kind == MapKind::kElu;
  const Shape shape{d, w, f, heads / kv, static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))),
                    static_cast<float>(eps)};
  return {ring_k.data_ptr(), ring_v.data_ptr(), ring_k.scalar_type() == at::kBFloat16, s.data_ptr<float>(),
          z.data_ptr<float>(), kv, shape,
          kind, std::move(weight_t), elu ? nullptr : map_bias->data_ptr<float>(), elu ? 0 : map_weight->size(1),
          mix.sigmoid().contiguous()};
}

// Where each row's new token's q, k and v are: row r's key head j has its key at k + r k_row + j k_head (and so
// for v), its group's first query at q + r q_row + j G q_head.
struct NewTokens {
  const float *q, *k, *v;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
};

// Every row's key heads of one layer: rows at `positions` (B,), outputs into out (B, H, D), the state in place; T the
// ring's numbers.
template <typename T>
void attend_rows_of(const HybridLayer& layer, const NewTokens& t, const int64_t* positions, int64_t b, float* out) {
  const int64_t kv = layer.kv, w = layer.shape.w, d = layer.shape.d, f = layer.shape.f, g = layer.shape.groups;
  const float* gates = layer.gates.data_ptr<float>();
  T* const ring_k = static_cast<T*>(layer.ring_k);
  T* const ring_v = static_cast<T*>(layer.ring_v);
  const auto key_head = [&](int64_t i) {  // i = r KV + j: row r's key head j
    const int64_t r = i / kv, j = i % kv;
    return KeyHead<T>{ring_k + i * w * d,
                   ring_v + i * w * d,
                   layer.s + i * f * d,
                   layer.z + i * f,
                   t.k + r * t.k_row + j * t.k_head,
                   t.v + r * t.v_row + j * t.v_head,
                   t.q + r * t.q_row + j * g * t.q_head,
                   t.q_head,
                   positions[r],
                   gates + j * g,
                   out + (r * kv + j) * g * d};
  };
  at::parallel_for(0, b * kv, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const bool more = i + 1 < last;
      const Ahead<T> ahead{more ? ring_k + (i + 1) * w * d : nullptr, more ? ring_v + (i + 1) * w * d : nullptr,
                           more ? layer.s + (i + 1) * f * d : nullptr};
      step_key_head(key_head(i), layer.map_of(i % kv), layer.shape, ahead);
    }
  });
}

void attend_rows(const HybridLayer& layer, const NewTokens& t, const int64_t* positions, int64_t b, float* out) {
  if (layer.bf16_ring)
    attend_rows_of<Bf16>(layer, t, positions, b, out);
  else
    attend_rows_of<float>(layer, t, positions, b, out);
}

}  // namespace
