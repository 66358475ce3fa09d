// The vector type of each CPU route (model/kernels/loader.py builds with the route's flags) and the few operations
// the kernels write their loops with: loads, stores, broadcast, fused multiply-add, a lane sum, and the two
// transcendental functions a decode step needs (exp of a non-positive number, for elu; erf, for GELU).
//
// Raw vector types, not at::vec::Vectorized: GCC keeps a 2-D array of these in registers, which it did not do
// for Vectorized's (three times slower here).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

#if defined(RNNSERVE_GENERIC_VECTORS)
// The compiler's vector extensions: any GCC or Clang target (NEON on ARM, SSE or AVX on x86) builds them.
using V = float __attribute__((vector_size(32)));
using VI = int32_t __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
constexpr int64_t kRows = 4;  // 4 x 2 accumulators of two 128-bit registers each where vectors are that wide
inline V vload(const float* p) { V v; __builtin_memcpy(&v, p, sizeof(V)); return v; }
inline void vstore(float* p, V v) { __builtin_memcpy(p, &v, sizeof(V)); }
inline V vbroadcast(float x) { return V{} + x; }
inline V vfma(V a, V b, V c) { return a * b + c; }  // fused where the target has FMA (-ffp-contract=fast)
inline float hsum(V v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
#elif defined(CPU_CAPABILITY_AVX512)
using V = __m512;
using VI = int32_t __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 8;  // 8 x 2 accumulators, 2 panel vectors and a broadcast: 19 of the 32 registers
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vbroadcast(float x) { return _mm512_set1_ps(x); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
#elif defined(CPU_CAPABILITY_AVX2)
using V = __m256;
using VI = int32_t __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
constexpr int64_t kRows = 6;  // 6 x 2 accumulators, 2 panel vectors and a broadcast: 15 of the 16 registers
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vbroadcast(float x) { return _mm256_set1_ps(x); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
using V = float;
using VI = int32_t;
constexpr int64_t kLanes = 1;
constexpr int64_t kRows = 8;
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V v) { *p = v; }
inline V vbroadcast(float x) { return x; }
inline V vfma(V a, V b, V c) { return a * b + c; }
inline float hsum(V v) { return v; }
#endif

// The first `left` of a vector's lanes at p (left < kLanes: a panel's columns past N are not there).
inline V load_part(const float* p, int64_t left) {
  alignas(64) float lanes[kLanes] = {};
  std::memcpy(lanes, p, left * sizeof(float));
  return vload(lanes);
}

inline void store_part(float* p, V v, int64_t left) {
  alignas(64) float lanes[kLanes];
  vstore(lanes, v);
  std::memcpy(p, lanes, left * sizeof(float));
}

inline VI bits(V x) { VI i; std::memcpy(&i, &x, sizeof(V)); return i; }
inline V from_bits(VI i) { V x; std::memcpy(&x, &i, sizeof(V)); return x; }
// kLanes bfloat16 numbers (their bits) widened to float32: a bfloat16 is a float32's high half.
inline V vload_bf16(const uint16_t* p) {
#if defined(RNNSERVE_GENERIC_VECTORS) || !(defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2))
  alignas(64) uint32_t lanes[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lanes[i] = static_cast<uint32_t>(p[i]) << 16;
  V x;
  std::memcpy(&x, lanes, sizeof(V));
  return x;
#elif defined(CPU_CAPABILITY_AVX512)
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
#else
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
#endif
}

inline V vmin(V a, V b) { return a < b ? a : b; }  // lane-wise on every route (GCC's vector conditionals)
inline V vmax(V a, V b) { return a > b ? a : b; }

// The largest and the smallest lane of v (exact in any order, unlike a sum).
inline float hmax(V v) {
#if defined(CPU_CAPABILITY_AVX512) && !defined(RNNSERVE_GENERIC_VECTORS)
  return _mm512_reduce_max_ps(v);
#else
  alignas(64) float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(V));
  float top = lanes[0];
  for (int64_t i = 1; i < kLanes; ++i) top = lanes[i] > top ? lanes[i] : top;
  return top;
#endif
}

inline float hmin(V v) { return -hmax(v * vbroadcast(-1.f)); }  // negation is exact, so this is exact too

// e^y for y <= 0 (larger y is not asked for), to float32's last bit or so: 2^n e^r with n = round(y / ln 2),
// r = y - n ln 2 in two parts, e^r by its Taylor polynomial; below -87 the result is flushed towards 0.
inline V exp_of_nonpositive(V y) {
  const V magic = vbroadcast(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer in the low mantissa bits
  y = vmax(y, vbroadcast(-87.f));
  const V shifted = vfma(y, vbroadcast(1.44269504f), magic);
  const V n = shifted - magic;
  const V r = vfma(n, vbroadcast(2.12194440e-4f), vfma(n, vbroadcast(-0.693359375f), y));
  V p = vbroadcast(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = vfma(p, r, vbroadcast(c));
  return p * from_bits((bits(shifted) - bits(magic) + 127) << 23);
}

// x Phi(x), Phi through erf (Abramowitz and Stegun 7.1.26, error below 1.5e-7): GELU as PyTorch's exact form.
inline V gelu(V x) {
  const VI sign = bits(x) & static_cast<int32_t>(0x80000000u);
  const V a = from_bits(bits(x) ^ sign) * vbroadcast(0.70710678f);  // |x| / sqrt 2
  const V t = vbroadcast(1.f) / vfma(a, vbroadcast(0.3275911f), vbroadcast(1.f));
  V poly = vbroadcast(1.061405429f);
  for (const float c : {-1.453152027f, 1.421413741f, -0.284496736f, 0.254829592f}) poly = vfma(poly, t, vbroadcast(c));
  const V erf = vbroadcast(1.f) - t * poly * exp_of_nonpositive(vbroadcast(0.f) - a * a);  // erf(|x| / sqrt 2)
  return x * vbroadcast(0.5f) * (vbroadcast(1.f) + from_bits(bits(erf) ^ sign));
}

// elu(x) + 1: the linear attention's feature map.
inline V elu_plus_one(V x) {
  const V zero = vbroadcast(0.f);
  return x > zero ? x + vbroadcast(1.f) : exp_of_nonpositive(vmin(x, zero));
}

}  // namespace
