// y = x W^T for group-quantized W (engine/quant/group_codes.py), W never expanded in memory:
//
//     W[r, c] = (lut[code[r, c]] - zero[r, c / G]) * (scale[r, c / G] (/|*) global[r])
//
// (global: one float32 per output row, or one for the whole weight, or none).
//
// Decode-sized products (M < gemm_rows): each thread takes a range of output rows and decodes each
// row once per chunk of up to 8 rows of x, 16 weights at a time in registers. Per group it folds
// zero and scale into its decoder once (a scaled 8-entry table in a register, or an offset and a
// factor) and computes each weight with exactly the float32 operations above, bit-equal to
// dequantize_group, so the result differs from the twin (dequantize + F.linear) by summation order
// only. For 1-2 rows of x, int4/uint4 and e4m3 instead keep the scale out of the inner loop:
// y = sum over groups of s * (dot(x, v) + c * sum(x)), W = (v + c) * s (two vector operations
// fewer per 8 weights; same tolerance, measured 5-15% faster). Larger products dequantize 256
// output rows at a time (bit-exact) into a scratch tile for ATen's GEMM. Scales may be float32,
// float16 or bfloat16, converted for 64 rows at a time into a small buffer: measured as fast as
// float32 scales (bench/group_linear.py), so the Python side passes them as stored.
//
// AVX2 decoders, chosen from the code table per call:
//   affine4  lut[i] == lut[0] + i, integers (int4, uint4): broadcast 4 code bytes, per-lane shift
//            (column order), mask, convert; zero and lut[0] are one integer offset;
//   sym4     lut[i + 8] == -lut[i], no zeros (e2m1): one permute of the scaled 8-entry table and
//            the sign from bit 3;
//   lut4     any 16-entry table: two permutes (entries 0-7 and 8-15) and a blend on bit 3;
//   e4m3     the FP8 table: the code's bits placed as float16 (value / 256), F16C conversion, the
//            factor 256 folded into the scale; NaN codes stay NaN;
//   gather8  any 256-entry table: AVX2 gather.
// Without AVX2 (or with portable=true, for the tests) a scalar decoder fills one group's weights
// into a buffer and the compiler vectorizes the dot products.
// Shapes: group sizes are multiples of 16 dividing K (so K is too; no column tails); any number of
// output rows (each row is independent) and of rows of x.
#include "group_packed.h"
#include "group_decoders_avx2.h"

namespace {


void gemv(const Packed& p, const float* x, int64_t M, float* y, int64_t N, bool portable) {
#ifdef DGPP_AVX2
  if (!portable) {
    switch (classify(p)) {
      case AFFINE4: return gemv_avx2<Affine4>(p, x, M, y, N);
      case SYM4: return gemv_avx2<Sym4>(p, x, M, y, N);
      case LUT4: return gemv_avx2<Lut4>(p, x, M, y, N);
      case E4M3: return gemv_avx2<E4m3>(p, x, M, y, N);
      case GATHER8: return gemv_avx2<Gather8>(p, x, M, y, N);
    }
  }
#endif
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { rows_portable(p, x, M, n0, n1, y, N); });
}

// Rows r0 .. r1 of W into out [(r1 - r0), K], in parallel.
void dequant(const Packed& p, int64_t r0, int64_t r1, float* out, bool portable) {
  int kind = -1;
#ifdef DGPP_AVX2
  if (!portable) kind = classify(p);
#endif
  at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) {
    float* o = out + (a - r0) * p.K;
    switch (kind) {
#ifdef DGPP_AVX2
      case AFFINE4: return dequant_rows_avx2<Affine4>(p, a, b, o);
      case SYM4: return dequant_rows_avx2<Sym4>(p, a, b, o);
      case LUT4: return dequant_rows_avx2<Lut4>(p, a, b, o);
      case E4M3: return dequant_rows_avx2<E4m3>(p, a, b, o);
      case GATHER8: return dequant_rows_avx2<Gather8>(p, a, b, o);
#endif
      default: return dequant_rows_portable(p, a, b, o);
    }
  });
}

Packed checked(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& zeros,
               const torch::Tensor& lut, int64_t bits, int64_t G, int64_t K,
               const torch::Tensor& global, int64_t global_mode) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, not ", bits);
  TORCH_CHECK(G > 0 && G % 16 == 0 && K % G == 0, "group size ", G,
              " must be a multiple of 16 dividing K = ", K);
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) == K * bits / 8,
              "codes must be contiguous uint8 [rows, K * bits / 8] for K = ", K);
  const int64_t N = codes.size(0), groups = K / G;
  const auto st = scales.scalar_type();
  TORCH_CHECK(st == torch::kFloat32 || st == torch::kFloat16 || st == torch::kBFloat16,
              "scales must be float32, float16 or bfloat16");
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == N &&
                  scales.size(1) == groups,
              "scales must be contiguous [rows, K / group_size]");
  const bool has_zeros = zeros.numel() > 0;
  TORCH_CHECK(!has_zeros || (zeros.scalar_type() == torch::kUInt8 && zeros.is_contiguous() &&
                             zeros.dim() == 2 && zeros.size(0) == N && zeros.size(1) == groups),
              "zeros must be empty or contiguous uint8 [rows, K / group_size]");
  TORCH_CHECK(lut.scalar_type() == torch::kFloat32 && lut.is_contiguous() &&
                  lut.numel() == (1 << bits),
              "lut must be float32 [2 ** bits]");
  TORCH_CHECK(global_mode >= 0 && global_mode <= 2, "global_mode must be 0, 1 (div) or 2 (mul)");
  TORCH_CHECK(global_mode == 0 || (global.scalar_type() == torch::kFloat32 &&
                                   global.is_contiguous() &&
                                   (global.numel() == 1 || global.numel() == N)),
              "global_scale must be contiguous float32 with 1 or rows values");
  return Packed{codes.data_ptr<uint8_t>(), codes.size(1), scales.data_ptr(), st,
                has_zeros ? zeros.data_ptr<uint8_t>() : nullptr, lut.data_ptr<float>(), bits, G, K,
                groups, global_mode == 0 ? nullptr : global.data_ptr<float>(),
                global_mode != 0 && global.numel() == N && N != 1, global_mode};
}

}  // namespace

// x: float32 [M, K]; returns float32 [M, rows] = x W^T.
torch::Tensor group_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           torch::Tensor zeros, torch::Tensor lut, int64_t bits, int64_t group_size,
                           torch::Tensor global_scale, int64_t global_mode, int64_t gemm_rows,
                           bool portable) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const Packed p =
      checked(codes, scales, zeros, lut, bits, group_size, K, global_scale, global_mode);
  const int64_t N = codes.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (M < gemm_rows) {
    gemv(p, x.data_ptr<float>(), M, y.data_ptr<float>(), N, portable);
    return y;
  }
  // Large M: dequantize 256 output rows at a time and multiply with ATen's GEMM.
  constexpr int64_t TILE = 256;
  auto scratch = torch::empty({std::min(TILE, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += TILE) {
    const int64_t rows = std::min(TILE, N - n0);
    dequant(p, n0, n0 + rows, scratch.data_ptr<float>(), portable);
    y.narrow(1, n0, rows).copy_(torch::mm(x, scratch.narrow(0, 0, rows).t()));
  }
  return y;
}

// W float32 [rows, cols], bit-equal to dequantize_group (an embedding's rows, tests).
torch::Tensor group_dequantize(torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros,
                               torch::Tensor lut, int64_t bits, int64_t group_size, int64_t cols,
                               torch::Tensor global_scale, int64_t global_mode, bool portable) {
  const Packed p =
      checked(codes, scales, zeros, lut, bits, group_size, cols, global_scale, global_mode);
  auto out = torch::empty({codes.size(0), cols}, torch::dtype(torch::kFloat32));
  if (out.numel() > 0) dequant(p, 0, codes.size(0), out.data_ptr<float>(), portable);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("group_linear", &group_linear, "y = x W^T for group-quantized W", py::arg("x"),
        py::arg("codes"), py::arg("scales"), py::arg("zeros"), py::arg("lut"), py::arg("bits"),
        py::arg("group_size"), py::arg("global_scale"), py::arg("global_mode"),
        py::arg("gemm_rows"), py::arg("portable") = false);
  m.def("group_dequantize", &group_dequantize, "group-quantized rows to float32", py::arg("codes"),
        py::arg("scales"), py::arg("zeros"), py::arg("lut"), py::arg("bits"),
        py::arg("group_size"), py::arg("cols"), py::arg("global_scale"), py::arg("global_mode"),
        py::arg("portable") = false);
}
