// y = x W^T for a few to a few dozen rows of x, with W decoded from its packed form a few rows at a
// time: the shape of chunked prefill, of a step's decode rows beside a chunk, and of batched
// decode. Such products are compute-bound (each weight meets every row of x), so this is a
// register-blocked float32 GEMM: a thread decodes NR output rows of W into a float scratch tile
// that stays in L1, then multiplies it with MR rows of x at a time, MR x NR accumulators held in
// vector registers over the whole reduction. Each weight is decoded once per call, and W's
// arithmetic is the dequantizer's (w as float32, then the products in float32), so results equal
// dequantize-then-F.linear up to summation order.
//
// Written with GCC/Clang vector extensions, not intrinsics: 16-float vectors where the compiler
// targets AVX-512, else 8-float ones (one AVX2 register, or two NEON registers on Arm), and the
// tile sizes chosen so accumulators, x and one W vector fit the register file.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace dgpp_tile {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector
constexpr int MR = 6;   // rows of x per tile: 24 accumulators of 32 registers
#else
constexpr int VW = 8;
constexpr int MR = 3;  // 12 accumulators of 16 AVX2 registers (or 32 NEON ones, two per vector)
#endif
constexpr int NR = 4;  // rows of W per tile
// From how many rows of x the tile GEMM beats decoding blocks in registers once per 8 rows
// (this project's 2-core Xeon: 16 with AVX2 alone, bench/ggml_linear.py; 16 with AVX-512 too
// since the 16-float block decoder of ggml_gemv.h, which measured 1.6-1.8x the tile GEMM at 8
// rows and even with it at 16 in a scratch A/B of both builds in one process, stop 57).
constexpr int64_t FROM_ROWS = 16;

typedef float vec __attribute__((vector_size(VW * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));

// The lanes' sum by halving (a few shuffles and adds, not VW - 1 dependent scalar adds).
inline float hsum(vec v) {
  vec8 h8;
#if defined(__AVX512F__)
  vec8 lo8, hi8;
  std::memcpy(&lo8, &v, sizeof lo8);
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof lo8, sizeof hi8);
  h8 = lo8 + hi8;
#else
  h8 = v;
#endif
  vec4 lo4, hi4;
  std::memcpy(&lo4, &h8, sizeof lo4);
  std::memcpy(&hi4, reinterpret_cast<const char*>(&h8) + sizeof lo4, sizeof hi4);
  const vec4 h4 = lo4 + hi4;
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// y[i * ldy + j] = x row i . w row j, for i < mr, j < nr; K a multiple of VW.
template <int mr, int nr>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  vec acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = vec{};
  for (int64_t k = 0; k < K; k += VW) {
    vec xv[mr];
    for (int i = 0; i < mr; ++i) xv[i] = load(x + i * ldx + k);
    for (int j = 0; j < nr; ++j) {
      const vec wv = load(w + j * K + k);
      for (int i = 0; i < mr; ++i) acc[i][j] += xv[i] * wv;
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) y[i * ldy + j] = hsum(acc[i][j]);
}

template <int nr>
inline void rows_of_x(const float* x, int64_t M, const float* w, int64_t K, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR, nr>(x + m * K, K, w, K, y + m * N, N);
  switch (M - m) {
    case 1: tile<1, nr>(x + m * K, K, w, K, y + m * N, N); break;
    case 2: tile<2, nr>(x + m * K, K, w, K, y + m * N, N); break;
#if defined(__AVX512F__)
    case 3: tile<3, nr>(x + m * K, K, w, K, y + m * N, N); break;
    case 4: tile<4, nr>(x + m * K, K, w, K, y + m * N, N); break;
    case 5: tile<5, nr>(x + m * K, K, w, K, y + m * N, N); break;
#endif
    default: break;
  }
}

// y [M, N] = x [M, K] W^T, W's rows decoded by `decode(n0, rows, out)` (rows <= NR consecutive
// rows from n0, as float32 [rows, K] into out); output rows split across ATen's threads.
template <typename Decode>
void gemm(const float* x, int64_t M, int64_t K, int64_t N, float* y, const Decode& decode) {
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(NR * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NR, rows = std::min<int64_t>(NR, N - n0);
      decode(n0, rows, scratch.data());
      float* yt = y + n0;
      switch (rows) {
        case 1: rows_of_x<1>(x, M, scratch.data(), K, yt, N); break;
        case 2: rows_of_x<2>(x, M, scratch.data(), K, yt, N); break;
        case 3: rows_of_x<3>(x, M, scratch.data(), K, yt, N); break;
        default: rows_of_x<NR>(x, M, scratch.data(), K, yt, N); break;
      }
    }
  });
}

}  // namespace dgpp_tile
