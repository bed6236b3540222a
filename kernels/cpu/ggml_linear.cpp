// y = x W^T for W stored as GGML blocks (Q4_0, Q4_1, Q8_0), W never expanded in memory.
//
// Decode-sized products (fewer rows of x than `tile_rows`): each thread takes a range of output
// rows, decodes each 32-weight block once into float registers and multiplies it with up to 8
// rows of x in float32 (the same arithmetic as dequantize-then-F.linear, up to summation order).
// Mid-sized ones (chunks, batched decode; below `gemm_rows`): the register-blocked tile GEMM of
// tile_gemm.h on blocks decoded a few output rows at a time. Larger products dequantize a tile of
// output rows into a scratch buffer and hand it to ATen's GEMM. Where the compiler targets AVX2
// (and AVX-512) the block decoders use intrinsics; elsewhere plain C++ for the auto-vectorizer
// (-O3 -march=native: NEON on Arm).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "ggml_gemv.h"
#include "tile_gemm.h"

using namespace dgpp_ggml;

// x: float32 [M, K] contiguous; w: uint8 [N, K / 32 * type_size]; returns float32 [M, N].
torch::Tensor ggml_linear(torch::Tensor x, torch::Tensor w, int64_t format, int64_t tile_rows,
                          int64_t gemm_rows) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2, "w must be uint8 [N, bytes]");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t ts = type_size(format);
  TORCH_CHECK(K % QK == 0 && w.size(1) == K / QK * ts, "w does not hold K = ", K, " weights per row");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  if (M >= tile_rows && M < gemm_rows) {
    dgpp_tile::gemm(xp, M, K, N, yp, [&](int64_t n0, int64_t rows, float* out) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < K / QK; ++b)
#ifdef DGPP_AVX2
          dequant_block_avx2(format, wp + (n0 + r) * row_bytes + b * ts, out + r * K + b * QK);
#else
          dequant_block(format, wp + (n0 + r) * row_bytes + b * ts, out + r * K + b * QK);
#endif
    });
    return y;
  }
  if (M < gemm_rows) {
#ifdef DGPP_AVX2
    {
      // Per-block sums of x, for the 8-float path's offset term.
      std::vector<float> xsum(USES_BLOCK_SUMS ? M * (K / QK) : 0);
      if (USES_BLOCK_SUMS) block_sums(xp, M, K, xsum.data());
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        gemv_rows_avx2(xp, M, K, wp, row_bytes, format, ts, n0, n1, yp, N, xsum.data());
      });
      return y;
    }
#endif
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      gemv_rows(xp, M, K, wp, row_bytes, format, ts, n0, n1, yp, N);
    });
    return y;
  }
  // Large M: dequantize 256 output rows at a time and multiply with ATen's GEMM.
  constexpr int64_t TILE = 256;
  auto scratch = torch::empty({std::min(TILE, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += TILE) {
    const int64_t rows = std::min(TILE, N - n0);
    float* sp = scratch.data_ptr<float>();
    at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < K / QK; ++b)
          dequant_block(format, wp + (n0 + r) * row_bytes + b * ts, sp + r * K + b * QK);
    });
    y.narrow(1, n0, rows).copy_(torch::mm(x, scratch.narrow(0, 0, rows).t()));
  }
  return y;
}

// Dequantize whole rows (the embedding lookup): w uint8 [R, bytes] -> float32 [R, K].
torch::Tensor ggml_dequantize(torch::Tensor w, int64_t format, int64_t K) {
  w = w.contiguous();
  const int64_t R = w.size(0), ts = type_size(format);
  TORCH_CHECK(K % QK == 0 && w.size(1) == K / QK * ts, "w does not hold K = ", K, " weights per row");
  auto out = torch::empty({R, K}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < K / QK; ++b)
        dequant_block(format, wp + r * w.size(1) + b * ts, op + r * K + b * QK);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ggml_linear", &ggml_linear, "y = x W^T for W in GGML blocks (Q4_0, Q4_1, Q8_0)");
  m.def("ggml_dequantize", &ggml_dequantize, "GGML rows to float32");
  m.def("tile_rows", [] { return dgpp_tile::FROM_ROWS; }, "rows of x from which the tile GEMM pays");
}
