// Rows through a bf16 linear layer on a CPU with no bf16 arithmetic (AVX2 + FMA): y[m, n] = sum_k x[m, k] * w[n, k]
// (+ bias[n]) in fp32, one bf16 rounding at the end. A bf16 value is the top half of an fp32 one, so each weight
// vector is widened in registers (zero-extend to 32 bits, shift left 16) and multiplied in fp32: the weights are
// read as bf16 (half fp32's bytes) and never written back widened. The inputs are widened once per call.
// A work item owns kBlock output rows; its input rows go through them in chunks of up to four (the first chunk
// reads the block's weights from memory, the next find them in L2), each chunk in register tiles of O output rows
// x R input rows (O * R accumulators of 8 lanes, within AVX2's 16 vector registers).
// Every output is the same sum in the same order whatever the number of rows or the tile that computes it (8
// lane-wise partial sums over k, then one fixed reduction): a row's result does not depend on the rows beside it,
// so a tree's verification and a batch compute each row as a one-row decode step does.
// Built by castspec/decode/widen_linear.py only on a CPU with AVX2 and FMA.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

namespace {

constexpr int kLanes = 8;    // fp32 lanes per 256-bit register
constexpr int kChunk = 4;    // input rows per pass over a block's weights
constexpr int kBlock = 24;   // output rows per work item: a multiple of every tile's O (8, 6, 4, 3)

// output rows per tile for a chunk of R input rows: O * R accumulators + R inputs + 1 weight <= 16 registers
template <int R> constexpr int tile_outputs() { return R == 1 ? 8 : R == 2 ? 6 : R == 3 ? 4 : 3; }

inline __m256 widen(const at::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// the one reduction every output takes: lanes (0+4, 1+5, 2+6, 3+7), then pairs, then the two halves
inline float reduce(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

template <int R>
void tile(const float* const* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* const* y,
          int64_t n, int outputs, int64_t in_features) {
  constexpr int O = tile_outputs<R>();
  const int64_t full = in_features / kLanes * kLanes;
  __m256 acc[O][R];
  const at::BFloat16* row[O];
#pragma GCC unroll 8
  for (int o = 0; o < O; ++o) {
    row[o] = w + (n + std::min(o, outputs - 1)) * in_features;  // a short last tile reads its last row again
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[o][r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < full; k += kLanes) {
    __m256 xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x[r] + k);
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) {
      const __m256 wv = widen(row[o] + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[o][r] = _mm256_fmadd_ps(wv, xv[r], acc[o][r]);
    }
  }
  for (int o = 0; o < outputs; ++o) {
    const float b = bias != nullptr ? static_cast<float>(bias[n + o]) : 0.0f;
    for (int r = 0; r < R; ++r) {
      float sum = reduce(acc[o][r]);
      for (int64_t k = full; k < in_features; ++k) sum += x[r][k] * static_cast<float>(row[o][k]);
      y[r][n + o] = at::BFloat16(sum + b);
    }
  }
}

template <int R>
void chunk(const float* const* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* const* y,
           int64_t n_begin, int64_t n_end, int64_t in_features) {
  constexpr int O = tile_outputs<R>();
  for (int64_t n = n_begin; n < n_end; n += O)
    tile<R>(x, w, bias, y, n, (int)std::min<int64_t>(O, n_end - n), in_features);
}

void block(const float* const* x, int64_t rows, const at::BFloat16* w, const at::BFloat16* bias,
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

torch::Tensor widen_linear(const torch::Tensor& x, const torch::Tensor& weight,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "widen_linear: bf16 only");
  TORCH_CHECK(weight.is_contiguous(), "widen_linear: a contiguous weight");
  const int64_t in_features = weight.size(1), out_features = weight.size(0);
  TORCH_CHECK(x.size(-1) == in_features, "widen_linear: input width ", x.size(-1), " != ", in_features);
  const auto wide = x.reshape({-1, in_features}).to(at::kFloat).contiguous();  // the inputs widened once
  const int64_t rows = wide.size(0);
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  auto y = torch::empty(shape, x.options());
  const at::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(), "widen_linear: a contiguous bf16 bias");
    b = bias->data_ptr<at::BFloat16>();
  }
  std::vector<const float*> xs(rows);
  std::vector<at::BFloat16*> ys(rows);
  for (int64_t m = 0; m < rows; ++m) {
    xs[m] = wide.data_ptr<float>() + m * in_features;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("widen_linear", &widen_linear, "bf16 rows through a bf16 linear layer in fp32 arithmetic (AVX2 + FMA)");
}
