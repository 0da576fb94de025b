// A few rows through a bf16 linear layer: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32 accumulation, one
// bf16 rounding at the end (as oneDNN rounds). The dense [out, in] weight is streamed from memory once for all
// rows: a work item owns kBlock output rows; its rows of x go through them in chunks of up to four (the first
// chunk reads the block's weights from memory, the next ones find them in L2), each chunk in register tiles of
// O output rows x R input rows of AVX512-BF16 pairwise dot products (O * R accumulators: at most 24 of the 32
// vector registers, the rest hold the chunk's inputs and one weight vector). The inputs stay in L1 / L2.
// Built by castspec/decode/row_linear.py only on a CPU that has AVX512-BF16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int kLanes = 32;   // bf16 values per 512-bit load
constexpr int kChunk = 4;    // input rows per pass over a block's weights
constexpr int kBlock = 24;   // output rows per work item: a multiple of every tile's O (8 and 6)

// output rows per tile for a chunk of R input rows: 8 (measured faster than 4 at one row on an AVX512-BF16
// EPYC), 6 for four rows so that the accumulators fit the registers
template <int R> constexpr int tile_outputs() { return R <= 3 ? 8 : 6; }

template <int R>
void tile(const at::BFloat16* const* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* const* y,
          int64_t n, int outputs, int64_t in_features) {
  constexpr int O = tile_outputs<R>();
  const int64_t full = in_features / kLanes * kLanes;
  const __mmask32 tail = (__mmask32)((1ull << (in_features - full)) - 1);
  __m512 acc[O][R];
  const at::BFloat16* row[O];
#pragma GCC unroll 8
  for (int o = 0; o < O; ++o) {
    row[o] = w + (n + std::min(o, outputs - 1)) * in_features;  // a short last tile reads its last row again
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < full; k += kLanes) {
    __m512bh xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_loadu_si512((const void*)(x[r] + k));
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(row[o] + k));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[o][r] = _mm512_dpbf16_ps(acc[o][r], wv, xv[r]);
    }
  }
  if (tail) {
    __m512bh xv[R];
    for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(tail, (const void*)(x[r] + full));
    for (int o = 0; o < O; ++o) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, (const void*)(row[o] + full));
      for (int r = 0; r < R; ++r) acc[o][r] = _mm512_dpbf16_ps(acc[o][r], wv, xv[r]);
    }
  }
  for (int o = 0; o < outputs; ++o) {
    const float b = bias != nullptr ? static_cast<float>(bias[n + o]) : 0.0f;
    for (int r = 0; r < R; ++r) y[r][n + o] = at::BFloat16(_mm512_reduce_add_ps(acc[o][r]) + b);
  }
}

template <int R>
void chunk(const at::BFloat16* const* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* const* y,
           int64_t n_begin, int64_t n_end, int64_t in_features) {
  constexpr int O = tile_outputs<R>();
  for (int64_t n = n_begin; n < n_end; n += O)
    tile<R>(x, w, bias, y, n, (int)std::min<int64_t>(O, n_end - n), in_features);
}

void block(const at::BFloat16* const* x, int64_t rows, const at::BFloat16* w, const at::BFloat16* bias,
           at::BFloat16* const* y, int64_t n_begin, int64_t n_end, int64_t in_features) {
  for (int64_t m = 0; m < rows; m += kChunk) {
    switch (std::min<int64_t>(kChunk, rows - m)) {
      case 1: chunk<1>(x + m, w, bias, y + m, n_begin, n_end, in_features); break;
      case 2: chunk<2>(x + m, w, bias, y + m, n_begin, n_end, in_features); break;
      case 3: chunk<3>(x + m, w, bias, y + m, n_begin, n_end, in_features); break;
      default: chunk<4>(x + m, w, bias, y + m, n_begin, n_end, in_features); break;
    }
  }
}

}  // namespace

torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "row_linear: bf16 only");
  TORCH_CHECK(weight.is_contiguous(), "row_linear: a contiguous weight");
  const int64_t in_features = weight.size(1), out_features = weight.size(0);
  TORCH_CHECK(x.size(-1) == in_features, "row_linear: input width ", x.size(-1), " != ", in_features);
  const auto xc = x.contiguous();
  const int64_t rows = xc.numel() / in_features;
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  auto y = torch::empty(shape, x.options());
  const at::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(), "row_linear: a contiguous bf16 bias");
    b = bias->data_ptr<at::BFloat16>();
  }
  std::vector<const at::BFloat16*> xs(rows);
  std::vector<at::BFloat16*> ys(rows);
  for (int64_t m = 0; m < rows; ++m) {
    xs[m] = xc.data_ptr<at::BFloat16>() + m * in_features;
    ys[m] = y.data_ptr<at::BFloat16>() + m * out_features;
  }
  const auto* wp = weight.data_ptr<at::BFloat16>();
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      block(xs.data(), rows, wp, b, ys.data(), i * kBlock, std::min(out_features, (i + 1) * kBlock), in_features);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("row_linear", &row_linear, "a few bf16 rows through a linear layer"); }
