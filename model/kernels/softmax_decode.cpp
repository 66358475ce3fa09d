// One query per row against a softmax KV cache on the CPU: a decode step's attention.
//
// Why a kernel: a decode step reads every cached key and value of every row once, so it is bound by memory
// bandwidth. Inductor lowers this single-query product to loops that read V once per 16 lanes of the head and
// keep one accumulator chain; this reads each row's keys and values side by side in one pass (online softmax,
// in blocks), with up to four independent accumulators, fetching ahead into the next row, and only the positions each
// row can see (its own length, not the batch's longest). The cache holds float32 or bfloat16 numbers (a bfloat16
// cache halves the bytes a step reads; they are widened to float32 as they load, and every sum is float32).
// Built by model/cpu_kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
using at::BFloat16;

// T: the cache's number type (float or BFloat16); q and out are float32.
template <typename T>
struct Row {
  const float* q;  // (D,)
  const T* k;  // (n, D), rows `k_stride` apart
  const T* v;  // (n, D), rows `v_stride` apart
  int64_t k_stride, v_stride, n, d;
  float* out;  // (D,)
};

// One vector of cached numbers, as float32.
inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const BFloat16* p) {
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}

float sum_lanes(const Vec& x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

constexpr int64_t kBlock = 16;  // positions scored, then weighed, together: keys and values stream side by side
constexpr int64_t kAhead = 32;  // positions fetched into L2 ahead of the one being scored, into the next row's

// Fetches position `p` of this row's keys and values, or of the next row's once past this row's end, so that
// the memory system is already bringing in what comes next when a row's two short streams end.
template <int V, typename T>
void prefetch_position(const Row<T>& r, const Row<T>* next, int64_t p) {
  const T *key = nullptr, *value = nullptr;
  if (p < r.n) {
    key = r.k + p * r.k_stride, value = r.v + p * r.v_stride;
  } else if (next != nullptr && p - r.n < next->n) {
    key = next->k + (p - r.n) * next->k_stride, value = next->v + (p - r.n) * next->v_stride;
  } else {
    return;
  }
  constexpr int64_t bytes = V * Vec::size() * sizeof(T);
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(key) + offset, 0, 2);
    __builtin_prefetch(reinterpret_cast<const char*>(value) + offset, 0, 2);
  }
}

// q . key at one position: a vector of partial sums, one per lane, not yet summed across lanes.
template <int V, typename T>
Vec partial_score(const Row<T>& r, const Vec* q, int64_t position) {
  const T* key = r.k + position * r.k_stride;
  Vec acc = load(key) * q[0];
  for (int j = 1; j < V; ++j) acc = at::vec::fmadd(load(key + j * Vec::size()), q[j], acc);
  return acc;
}

// Scores of positions [from, from + n) into `scores` (q . k_l, q already scaled); returns their maximum.
template <int V, typename T>
float score_block(const Row<T>& r, const Row<T>* next, const Vec* q, int64_t from, int64_t n, float* scores) {
  float most = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {  // positions are independent: the core overlaps their reductions
    prefetch_position<V>(r, next, from + i + kAhead);
    scores[i] = sum_lanes(partial_score<V>(r, q, from + i));
    most = std::max(most, scores[i]);
  }
  return most;
}

// weights <- exp(weights - most) for n of them, added into `total` lane by lane (summed across lanes once, at
// the row's end); the last vector's lanes past n are exp(-inf) = 0.
void exponentiate(float* weights, int64_t n, float most, Vec& total) {
  const int64_t w = Vec::size();
  for (int64_t i = n; i % w != 0; ++i) weights[i] = -std::numeric_limits<float>::infinity();
  const Vec shift(most);
  for (int64_t i = 0; i < n; i += w) {
    const Vec e = (Vec::loadu(weights + i) - shift).exp_u20();
    e.store(weights + i);
    total = total + e;
  }
}

// Independent accumulator chains for the weighted sum: as many as the registers hold beside q.
template <int V>
constexpr int kChains = V <= 2 ? 4 : (V <= 4 ? 2 : 1);

// acc += sum_i weights[i] v_(from + i), positions dealt round the accumulators (no one long chain).
template <int V, typename T>
void weigh_block(const Row<T>& r, const float* weights, int64_t from, int64_t n, Vec (&acc)[kChains<V>][V]) {
  constexpr int64_t w = Vec::size(), chains = kChains<V>;
  int64_t i = 0;
  for (; i + chains <= n; i += chains)
    for (int64_t u = 0; u < chains; ++u) {
      const Vec weight(weights[i + u]);
      const T* value = r.v + (from + i + u) * r.v_stride;
      for (int j = 0; j < V; ++j) acc[u][j] = at::vec::fmadd(weight, load(value + j * w), acc[u][j]);
    }
  for (; i < n; ++i)
    for (int j = 0; j < V; ++j)
      acc[0][j] = at::vec::fmadd(Vec(weights[i]), load(r.v + (from + i) * r.v_stride + j * w), acc[0][j]);
}

// One pass over the row in blocks (online softmax): each block's keys, then its values while they are in L1;
// the sums so far are rescaled whenever a block raises the running maximum. V vectors a head, known when
// compiling, so that q and the sums live in registers.
template <int V, typename T>
void attend_vectorized(const Row<T>& r, const Row<T>* next) {
  constexpr int64_t w = Vec::size(), chains = kChains<V>;
  Vec q[V], acc[chains][V];
  const Vec scale(1.0f / std::sqrt(static_cast<float>(r.d)));
  for (int j = 0; j < V; ++j) {
    q[j] = Vec::loadu(r.q + j * w) * scale;
    for (auto& a : acc) a[j] = Vec(0.0f);
  }
  float most = -std::numeric_limits<float>::infinity();
  Vec total(0.0f);
  alignas(64) float weights[kBlock];
  for (int64_t from = 0; from < r.n; from += kBlock) {
    const int64_t n = std::min(kBlock, r.n - from);
    const float block_most = score_block<V>(r, next, q, from, n, weights);
    if (block_most > most) {
      const Vec shrink(std::exp(most - block_most));  // 0 on the first block
      for (auto& a : acc)
        for (int j = 0; j < V; ++j) a[j] = a[j] * shrink;
      total = total * shrink;
      most = block_most;
    }
    exponentiate(weights, n, most, total);
    weigh_block<V>(r, weights, from, n, acc);
  }
  const Vec inverse(1.0f / sum_lanes(total));
  for (int j = 0; j < V; ++j) {
    Vec sum = acc[0][j];
    for (int64_t u = 1; u < chains; ++u) sum = sum + acc[u][j];
    (sum * inverse).store(r.out + j * w);
  }
}

// The same three steps, one number at a time: head sizes the vector path does not cover.
template <typename T>
void attend_scalar(const Row<T>& r, float* scores) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(r.d));
  float most = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < r.n; ++l) {
    float dot = 0.0f;
    for (int64_t j = 0; j < r.d; ++j) dot += r.q[j] * static_cast<float>(r.k[l * r.k_stride + j]);
    scores[l] = dot * scale;
    most = std::max(most, scores[l]);
  }
  float total = 0.0f;
  for (int64_t l = 0; l < r.n; ++l) total += scores[l] = std::exp(scores[l] - most);
  for (int64_t j = 0; j < r.d; ++j) {
    float sum = 0.0f;
    for (int64_t l = 0; l < r.n; ++l) sum += scores[l] * static_cast<float>(r.v[l * r.v_stride + j]);
    r.out[j] = sum / total;
  }
}

// Vectorized when the head is a whole number of vectors (up to 8), else one number at a time.
template <typename T>
void attend(const Row<T>& r, const Row<T>* next, float* scores) {
  const int64_t w = Vec::size();
  switch (r.d % w == 0 ? r.d / w : 0) {
    case 1: return attend_vectorized<1>(r, next);
    case 2: return attend_vectorized<2>(r, next);
    case 3: return attend_vectorized<3>(r, next);
    case 4: return attend_vectorized<4>(r, next);
    case 5: return attend_vectorized<5>(r, next);
    case 6: return attend_vectorized<6>(r, next);
    case 7: return attend_vectorized<7>(r, next);
    case 8: return attend_vectorized<8>(r, next);
    default: return attend_scalar(r, scores);
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& last) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "q must be (B, H, 1, D), got ", q.sizes());
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "k and v caches must both be (B, H, L, D), got ", k.sizes(),
              " and ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
              "caches ", k.sizes(), " do not match q ", q.sizes());
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.stride(3) == 1,
              "q must be a float32 CPU tensor with unit stride along D");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "k and v caches must both be float32 or both bfloat16, got ", k.scalar_type(), " and ",
              v.scalar_type());
  for (const auto* t : {&k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->stride(3) == 1, "k and v caches must be CPU tensors with unit stride along D");
  TORCH_CHECK(last.dim() == 1 && last.size(0) == q.size(0) && last.scalar_type() == at::kLong,
              "last must be (B,) int64, got ", last.sizes());
}

// Every (row, head) pair in parallel, each fetching ahead into the next pair of its share.
template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* end, at::Tensor& out) {
  const int64_t heads = q.size(1), d = q.size(3), max_len = k.size(2);
  const float* qp = q.data_ptr<float>();
  const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  float* op = out.data_ptr<float>();
  auto row_at = [&](int64_t i) {
    const int64_t b = i / heads, h = i % heads;
    return Row<T>{qp + b * q.stride(0) + h * q.stride(1), kp + b * k.stride(0) + h * k.stride(1),
                  vp + b * v.stride(0) + h * v.stride(1), k.stride(2), v.stride(2), end[b] + 1, d, op + i * d};
  };
  at::parallel_for(0, q.size(0) * heads, 1, [&](int64_t begin, int64_t finish) {
    std::vector<float> scores(max_len);  // the scalar path's
    for (int64_t i = begin; i < finish; ++i) {
      const Row<T> row = row_at(i);
      const Row<T> next = row_at(i + 1 < finish ? i + 1 : i);
      attend(row, i + 1 < finish ? &next : nullptr, scores.data());
    }
  });
}

}  // namespace

// q (B, H, 1, D) float32 attends to positions [0, last[b]] of caches (B, H, L, D), float32 or bfloat16:
// returns (B, H, 1, D) float32.
at::Tensor softmax_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& last) {
  check_inputs(q, k, v, last);
  const at::Tensor ends = last.contiguous();
  const int64_t* end = ends.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(end[b] >= 0 && end[b] < k.size(2), "row ", b, ": last position ", end[b], " outside the cache's ",
                k.size(2));
  at::Tensor out = at::empty({q.size(0), q.size(1), 1, q.size(3)}, q.options());
  if (k.scalar_type() == at::kBFloat16)
    attend_all<BFloat16>(q, k, v, end, out);
  else
    attend_all<float>(q, k, v, end, out);
  return out;
}

TORCH_LIBRARY(rnnserve, m) {
  m.def("softmax_decode_attention(Tensor q, Tensor k, Tensor v, Tensor last) -> Tensor");
}

TORCH_LIBRARY_IMPL(rnnserve, CPU, m) { m.impl("softmax_decode_attention", &softmax_decode_attention); }
