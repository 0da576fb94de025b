// One row through a bf16 linear layer: y[n] = sum_k x[k] * w[n, k] (+ bias[n]), fp32 accumulation, one bf16
// rounding at the end (as oneDNN rounds). The dense [out, in] weight is streamed once, eight output rows at a
// time (eight read streams, eight accumulators), with AVX512-BF16's pairwise dot product; the input row stays in
// L1. Built by castspec/decode/row_linear.py only on a CPU that has AVX512-BF16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int kRows = 8;     // output rows per block: measured faster than 4 on an AVX512-BF16 EPYC
constexpr int kLanes = 32;   // bf16 values per 512-bit load

void row_block(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y,
               int64_t n_begin, int64_t n_end, int64_t in_features) {
  const int64_t full = in_features / kLanes * kLanes;
  const __mmask32 tail = (__mmask32)((1ull << (in_features - full)) - 1);
  for (int64_t n = n_begin; n < n_end; n += kRows) {
    const int rows = (int)std::min<int64_t>(kRows, n_end - n);
    __m512 acc[kRows];
    const at::BFloat16* row[kRows];
    for (int r = 0; r < kRows; ++r) {
      acc[r] = _mm512_setzero_ps();
      row[r] = w + (n + std::min(r, rows - 1)) * in_features;  // a short last block reads its last row again
    }
    for (int64_t k = 0; k < full; k += kLanes) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(x + k));
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512((const void*)(row[r] + k)), xv);
    }
    if (tail) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, (const void*)(x + full));
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, (const void*)(row[r] + full)), xv);
    }
    for (int r = 0; r < rows; ++r) {
      float sum = _mm512_reduce_add_ps(acc[r]);
      if (bias != nullptr) sum += static_cast<float>(bias[n + r]);
      y[n + r] = at::BFloat16(sum);
    }
  }
}

}  // namespace

torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "row_linear: bf16 only");
  TORCH_CHECK(x.numel() == x.size(-1) && weight.is_contiguous(), "row_linear: one row, a contiguous weight");
  const int64_t in_features = weight.size(1), out_features = weight.size(0);
  TORCH_CHECK(x.size(-1) == in_features, "row_linear: input width ", x.size(-1), " != ", in_features);
  const auto xc = x.contiguous();
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  auto y = torch::empty(shape, x.options());
  const at::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(), "row_linear: a contiguous bf16 bias");
    b = bias->data_ptr<at::BFloat16>();
  }
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const auto* wp = weight.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t blocks = (out_features + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    row_block(xp, wp, b, yp, begin * kRows, std::min(out_features, end * kRows), in_features);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("row_linear", &row_linear, "one bf16 row through a linear layer"); }
