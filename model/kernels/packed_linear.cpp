// A linear layer for decode steps on the CPU: out = x W^T + b for a few dozen rows, float32.
//
// Why a kernel: a decode step's products are small (64 rows by 128-512 columns), where MKL's sgemm runs its
// AVX2 code on AMD CPUs and oneDNN's AVX-512 one pays a fixed cost per call before any arithmetic (17 calls a
// step; benchmarks/results/NOTES.md has the figures). The product itself, on W packed once into panels of one vector
// of output columns, is model/kernels/packed_product.h; this file packs W and is the operator. Built by
// model/kernels/loader.py, with the flags of the route it picks (RNNSERVE_CPU_ROUTE forces one).
#include <torch/extension.h>

#include "packed_product.h"

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
  packed_product({xc.data_ptr<float>(), packed.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                  out.data_ptr<float>(), m, k, n});
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
