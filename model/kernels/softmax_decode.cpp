// One query per row against a softmax KV cache on the CPU: a decode step's attention (and Reformer's, at the end).
//
// Why a kernel: a decode step reads every cached key and value of every row once, so it is bound by memory
// bandwidth. Inductor lowers this single-query product to loops that read V once per 16 lanes of the head and
// keep one accumulator chain; this reads each row's keys and values side by side in one pass (online softmax,
// in blocks), with up to four independent accumulators, fetching ahead into the next row, and only the positions each
// row can see (its own length, not the batch's longest). The cache holds float32 or bfloat16 numbers (a bfloat16
// cache halves the bytes a step reads; they are widened to float32 as they load, and every sum is float32).
// Built by model/kernels/loader.py.
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
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "k and v caches must both be (B, KV, L, D), got ", k.sizes(),
              " and ", v.sizes());
  // Grouped-query attention: each key head serves H / KV query heads side by side (query head h reads key head
  // h / (H / KV), as the eager path's unflatten of the heads into (KV, H / KV) pairs them).
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) >= 1 && q.size(1) % k.size(1) == 0 && k.size(3) == q.size(3),
              "caches ", k.sizes(), " do not match q ", q.sizes(), ": expected (B, KV, L, D) with KV dividing H");
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

// Every (row, query head) pair in parallel, each fetching ahead into the next pair of its share. The query heads
// of one key head are neighbours, so a share reads a key head's cache once from memory and again from cache.
template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* end, at::Tensor& out) {
  const int64_t heads = q.size(1), group = q.size(1) / k.size(1), d = q.size(3), max_len = k.size(2);
  const float* qp = q.data_ptr<float>();
  const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  float* op = out.data_ptr<float>();
  auto row_at = [&](int64_t i) {
    const int64_t b = i / heads, h = i % heads, kv = h / group;
    return Row<T>{qp + b * q.stride(0) + h * q.stride(1), kp + b * k.stride(0) + kv * k.stride(1),
                  vp + b * v.stride(0) + kv * v.stride(1), k.stride(2), v.stride(2), end[b] + 1, d, op + i * d};
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


// ---- Reformer: one query per row against the keys its rounds show, read from a cache written by position ----
//
// A key is shown by each hashed round whose bucket it shares with the query (earlier keys only), and by the local
// round when it is one of the `window` keys before the query; the query's own key (written at `last`) is shown by
// each round that shows nothing else. Rounds mix as one softmax in which a key counts once per round showing it:
// scores + log(count) (model/attention/reformer/visibility.py). Only the shown keys and values are read: with n buckets
// a step reads about 1/n of the keys softmax's would, plus one byte per position and round for the bucket ids.

// Shown positions of one (row, head) and how many rounds show each, the query's own position last.
struct Shown {
  std::vector<int64_t> positions;
  std::vector<float> bias;  // log(count)
};

void list_shown(const uint8_t* key_buckets, int64_t bucket_stride, const int64_t* query_buckets, int64_t rounds,
                int64_t last, int64_t window, Shown& shown) {
  shown.positions.clear();
  shown.bias.clear();
  std::vector<float> log_count(rounds + 2);
  for (int64_t c = 1; c < rounds + 2; ++c) log_count[c] = std::log(static_cast<float>(c));
  std::vector<bool> found(rounds, false);
  const int64_t window_start = window > 0 ? last - window : last;
  for (int64_t l = 0; l < last; ++l) {
    int64_t count = l >= window_start ? 1 : 0;
    for (int64_t r = 0; r < rounds; ++r)
      if (key_buckets[r * bucket_stride + l] == query_buckets[r]) ++count, found[r] = true;
    if (count > 0) shown.positions.push_back(l), shown.bias.push_back(log_count[count]);
  }
  int64_t own = window > 0 && last == 0 ? 1 : 0;  // the local round shows nothing before position 0
  for (int64_t r = 0; r < rounds; ++r) own += found[r] ? 0 : 1;
  if (own > 0) shown.positions.push_back(last), shown.bias.push_back(log_count[own]);
}

// The listed positions in blocks (online softmax), as attend_vectorized does for a whole prefix.
template <int V, typename T>
void attend_listed_vectorized(const Row<T>& r, const Shown& shown) {
  constexpr int64_t w = Vec::size(), chains = kChains<V>;
  Vec q[V], acc[chains][V];
  const Vec scale(1.0f / std::sqrt(static_cast<float>(r.d)));
  for (int j = 0; j < V; ++j) {
    q[j] = Vec::loadu(r.q + j * w) * scale;
    for (auto& a : acc) a[j] = Vec(0.0f);
  }
  const int64_t count = static_cast<int64_t>(shown.positions.size());
  float most = -std::numeric_limits<float>::infinity();
  Vec total(0.0f);
  alignas(64) float weights[kBlock];
  for (int64_t from = 0; from < count; from += kBlock) {
    const int64_t n = std::min(kBlock, count - from);
    float block_most = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      if (from + i + kAhead < count) {
        const int64_t ahead = shown.positions[from + i + kAhead];
        __builtin_prefetch(r.k + ahead * r.k_stride, 0, 2);
        __builtin_prefetch(r.v + ahead * r.v_stride, 0, 2);
      }
      weights[i] = sum_lanes(partial_score<V>(r, q, shown.positions[from + i])) + shown.bias[from + i];
      block_most = std::max(block_most, weights[i]);
    }
    if (block_most > most) {
      const Vec shrink(std::exp(most - block_most));  // 0 on the first block
      for (auto& a : acc)
        for (int j = 0; j < V; ++j) a[j] = a[j] * shrink;
      total = total * shrink;
      most = block_most;
    }
    exponentiate(weights, n, most, total);
    for (int64_t i = 0; i < n; ++i) {
      const Vec weight(weights[i]);
      const T* value = r.v + shown.positions[from + i] * r.v_stride;
      auto& a = acc[i % chains];
      for (int j = 0; j < V; ++j) a[j] = at::vec::fmadd(weight, load(value + j * w), a[j]);
    }
  }
  const Vec inverse(1.0f / sum_lanes(total));
  for (int j = 0; j < V; ++j) {
    Vec sum = acc[0][j];
    for (int64_t u = 1; u < chains; ++u) sum = sum + acc[u][j];
    (sum * inverse).store(r.out + j * w);
  }
}

// The same, one number at a time: head sizes the vector path does not cover.
template <typename T>
void attend_listed_scalar(const Row<T>& r, const Shown& shown, std::vector<float>& scores) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(r.d));
  const int64_t count = static_cast<int64_t>(shown.positions.size());
  scores.resize(count);
  float most = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < count; ++i) {
    const T* key = r.k + shown.positions[i] * r.k_stride;
    float dot = 0.0f;
    for (int64_t j = 0; j < r.d; ++j) dot += r.q[j] * static_cast<float>(key[j]);
    scores[i] = dot * scale + shown.bias[i];
    most = std::max(most, scores[i]);
  }
  float total = 0.0f;
  for (int64_t i = 0; i < count; ++i) total += scores[i] = std::exp(scores[i] - most);
  for (int64_t j = 0; j < r.d; ++j) {
    float sum = 0.0f;
    for (int64_t i = 0; i < count; ++i) sum += scores[i] * static_cast<float>(r.v[shown.positions[i] * r.v_stride + j]);
    r.out[j] = sum / total;
  }
}

template <typename T>
void attend_listed(const Row<T>& r, const Shown& shown, std::vector<float>& scores) {
  const int64_t w = Vec::size();
  switch (r.d % w == 0 ? r.d / w : 0) {
    case 1: return attend_listed_vectorized<1>(r, shown);
    case 2: return attend_listed_vectorized<2>(r, shown);
    case 3: return attend_listed_vectorized<3>(r, shown);
    case 4: return attend_listed_vectorized<4>(r, shown);
    case 5: return attend_listed_vectorized<5>(r, shown);
    case 6: return attend_listed_vectorized<6>(r, shown);
    case 7: return attend_listed_vectorized<7>(r, shown);
    case 8: return attend_listed_vectorized<8>(r, shown);
    default: return attend_listed_scalar(r, shown, scores);
  }
}

template <typename T>
void attend_shown_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_buckets,
                      const at::Tensor& query_buckets, const int64_t* last, int64_t window, at::Tensor& out) {
  const int64_t heads = q.size(1), d = q.size(3), rounds = key_buckets.size(2);
  const float* qp = q.data_ptr<float>();
  const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const uint8_t* bp = key_buckets.data_ptr<uint8_t>();
  const int64_t* qbp = query_buckets.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, q.size(0) * heads, 1, [&](int64_t begin, int64_t finish) {
    Shown shown;
    std::vector<float> scores;  // the scalar path's
    for (int64_t i = begin; i < finish; ++i) {
      const int64_t b = i / heads, h = i % heads;
      const Row<T> row{qp + b * q.stride(0) + h * q.stride(1), kp + b * k.stride(0) + h * k.stride(1),
                       vp + b * v.stride(0) + h * v.stride(1), k.stride(2), v.stride(2), last[b] + 1, d, op + i * d};
      list_shown(bp + b * key_buckets.stride(0) + h * key_buckets.stride(1), key_buckets.stride(2),
                 qbp + (b * heads + h) * rounds, rounds, last[b], window, shown);
      attend_listed(row, shown, scores);
    }
  });
}

}  // namespace

// q (B, H, 1, D) float32 attends to positions [0, last[b]] of caches (B, KV, L, D), float32 or bfloat16, KV dividing
// H (grouped-query attention when fewer): returns (B, H, 1, D) float32.
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


// Reformer's step: q (B, H, 1, D) float32 attends to the keys of caches (B, H, L, D), float32 or bfloat16, that its
// rounds show: key_buckets (B, H, R, L) uint8 (the query's own bucket already written at `last`), query_buckets
// (B, H, R) int64, last (B,) int64 the query's position, window the local round's width (0: none).
at::Tensor reformer_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& key_buckets, const at::Tensor& query_buckets,
                                     const at::Tensor& last, int64_t window) {
  check_inputs(q, k, v, last);
  TORCH_CHECK(k.size(1) == q.size(1), "Reformer's caches must have q's ", q.size(1), " heads, got ", k.sizes());
  TORCH_CHECK(key_buckets.dim() == 4 && key_buckets.size(0) == k.size(0) && key_buckets.size(1) == k.size(1) &&
                  key_buckets.size(3) == k.size(2) && key_buckets.size(2) >= 1,
              "key_buckets must be (B, H, R, L) for caches ", k.sizes(), ", got ", key_buckets.sizes());
  TORCH_CHECK(key_buckets.scalar_type() == at::kByte && key_buckets.stride(3) == 1,
              "key_buckets must be uint8 with unit stride along L");
  TORCH_CHECK(window >= 0, "window must be >= 0, got ", window);
  const at::Tensor wanted = query_buckets.to(at::kLong).contiguous();
  TORCH_CHECK(wanted.dim() == 3 && wanted.size(0) == q.size(0) && wanted.size(1) == q.size(1) &&
                  wanted.size(2) == key_buckets.size(2),
              "query_buckets must be (B, H, R), got ", query_buckets.sizes());
  const at::Tensor ends = last.contiguous();
  const int64_t* end = ends.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(end[b] >= 0 && end[b] < k.size(2), "row ", b, ": last position ", end[b], " outside the cache's ",
                k.size(2));
  at::Tensor out = at::empty({q.size(0), q.size(1), 1, q.size(3)}, q.options());
  if (k.scalar_type() == at::kBFloat16)
    attend_shown_all<BFloat16>(q, k, v, key_buckets, wanted, end, window, out);
  else
    attend_shown_all<float>(q, k, v, key_buckets, wanted, end, window, out);
  return out;
}

TORCH_LIBRARY(rnnserve, m) {
  m.def("softmax_decode_attention(Tensor q, Tensor k, Tensor v, Tensor last) -> Tensor");
  m.def(
      "reformer_decode_attention(Tensor q, Tensor k, Tensor v, Tensor key_buckets, Tensor query_buckets, "
      "Tensor last, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(rnnserve, CPU, m) {
  m.impl("softmax_decode_attention", &softmax_decode_attention);
  m.impl("reformer_decode_attention", &reformer_decode_attention);
}
