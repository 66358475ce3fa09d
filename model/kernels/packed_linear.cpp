// A linear layer for decode steps on the CPU: out = x W^T + b for a few dozen rows, float32.
//
// Why a kernel: a decode step's products are small (64 rows by 128-512 columns), where MKL's sgemm runs its
// AVX2 code on AMD CPUs and oneDNN's AVX-512 one pays a fixed cost per call before any arithmetic (17 calls a
// step; benchmarks/results/NOTES.md has the figures). The product itself, on W packed once into panels of one vector
// of output columns, is model/kernels/packed_product.h; this file packs W and is the operator. Built by
// model/kernels/loader.py, with the flags of the route it picks (RNNSERVE_CPU_ROUTE forces one).
#include <torch/extension.h>

#include "packed_product.h"
#include "packed_product_bf16.h"

// bfloat16 W (N, K) -> P (ceil(N / L), ceil(K / 2), L) 32-bit words, each a pair of inputs (packed_product_bf16.h).
torch::Tensor pack_linear_weight_bf16(const torch::Tensor& weight) {
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), count = (n + kLanes - 1) / kLanes, pairs = (k + 1) / 2;
  auto packed = torch::zeros({count, pairs, kLanes}, w.options().dtype(torch::kInt));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  for (int64_t o = 0; o < n; ++o)
    for (int64_t i = 0; i < k; ++i)
      dst[((o / kLanes) * pairs + i / 2) * kLanes + o % kLanes] |= static_cast<uint32_t>(src[o * k + i]) << (16 * (i % 2));
  return packed;
}

// W (N, K) -> P (ceil(N / L), K, L), L this build's vector width in floats; bfloat16 W as pack_linear_weight_bf16.
torch::Tensor pack_linear_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == torch::kFloat || weight.scalar_type() == torch::kBFloat16) &&
                  weight.device().is_cpu(),
              "pack_linear_weight: a 2-D float32 or bfloat16 CPU weight (out_features, in_features), got ",
              weight.sizes(), " ", weight.scalar_type());
  if (weight.scalar_type() == torch::kBFloat16) return pack_linear_weight_bf16(weight);
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), count = (n + kLanes - 1) / kLanes;
  auto packed = torch::zeros({count, k, kLanes}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  for (int64_t o = 0; o < n; ++o)
    for (int64_t i = 0; i < k; ++i) dst[((o / kLanes) * k + i) * kLanes + o % kLanes] = src[o * k + i];
  return packed;
}

// bfloat16 x (..., K) -> (..., N): x W^T + bias summed in float32 and rounded once, W packed by
// pack_linear_weight_bf16.
torch::Tensor packed_linear_bf16(const torch::Tensor& x, const torch::Tensor& packed,
                                 const c10::optional<torch::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() >= 1 && packed.scalar_type() == torch::kInt && packed.dim() == 3 && packed.size(2) == kLanes &&
                  packed.size(0) * kLanes >= n && (x.size(-1) + 1) / 2 == packed.size(1),
              "packed_linear: bfloat16 x (..., K) and weights packed by pack_linear_weight from a bfloat16 weight "
              "in this build");
  TORCH_CHECK(x.device().is_cpu() && (!bias.has_value() || (bias->scalar_type() == torch::kBFloat16 && bias->numel() == n)),
              "packed_linear: a CPU x and a bfloat16 bias of ", n, " numbers");
  const int64_t k = x.size(-1), pairs = packed.size(1);
  auto rows = x.reshape({-1, k});
  if (k % 2) rows = torch::constant_pad_nd(rows, {0, 1});  // the odd input's partner: a zero, as in the panels
  rows = rows.contiguous();
  const auto wide = kBf16Dot ? torch::Tensor() : rows.to(torch::kFloat);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, x.options());
  const auto b = bias.has_value() ? bias->to(torch::kFloat).contiguous() : torch::Tensor();
  packed_product_bf16({reinterpret_cast<const uint32_t*>(rows.data_ptr<at::BFloat16>()),
                       wide.defined() ? wide.data_ptr<float>() : nullptr,
                       reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
                       b.defined() ? b.data_ptr<float>() : nullptr, reinterpret_cast<c10::BFloat16*>(out.data_ptr()),
                       rows.size(0), pairs, n});
  return out;
}

// x (..., K) -> (..., N): x W^T + bias, W given packed by pack_linear_weight (bfloat16 x: packed_linear_bf16).
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                            int64_t n) {
  if (x.scalar_type() == torch::kBFloat16) return packed_linear_bf16(x, packed, bias, n);
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
  packed_product({xc.data_ptr<float>(), packed.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                  out.data_ptr<float>(), m, k, n});
  return out;
}

// packed_linear, or PyTorch's linear of dense_weight (W itself) for inputs of more than dense_rows rows: for
// bfloat16, whose products PyTorch runs on matrix units where the CPU has them (faster than the kernel's from a
// few rows up, slower below, where a decode step's time is the weights' bytes).
torch::Tensor packed_linear_or_dense(const torch::Tensor& x, const torch::Tensor& packed,
                                     const c10::optional<torch::Tensor>& bias, int64_t n,
                                     const torch::Tensor& dense_weight, int64_t dense_rows) {
  const int64_t rows = x.size(-1) ? x.numel() / x.size(-1) : 0;
  if (rows > dense_rows) return at::linear(x, dense_weight, bias);
  return packed_linear(x, packed, bias, n);
}

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("packed_linear_or_dense(Tensor x, Tensor packed, Tensor? bias, int n, Tensor dense_weight, int dense_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(rnnserve, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_linear_or_dense", &packed_linear_or_dense);
}
