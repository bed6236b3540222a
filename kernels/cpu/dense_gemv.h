// Decode-sized products over dense weight rows of float32, bfloat16 or float16: each row read as
// stored and widened to float32 in registers (16-bit weights stream at half the bytes of float32
// ones), products and sums in float32. Written with GCC/Clang vector extensions (tile_gemm.h's
// vectors): AVX-512 or AVX2 on x86, NEON on Arm, from the same source.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tile_gemm.h"

namespace dgpp_dense {

using dgpp_tile::vec;
using dgpp_tile::VW;

// Weight kinds: GGML's type ids.
enum Kind : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30 };

typedef uint16_t hvec __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint32_t uvec __attribute__((vector_size(VW * sizeof(uint32_t))));
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
typedef _Float16 fvec16 __attribute__((vector_size(VW * sizeof(_Float16))));
#define DGPP_FLOAT16_VECTORS 1
#endif

// VW weights of one row as float32 vectors, from their stored type.
template <int64_t kind>
inline vec load_weights(const uint8_t* p) {
  if constexpr (kind == F32) {
    return dgpp_tile::load(reinterpret_cast<const float*>(p));
  } else if constexpr (kind == BF16) {
    hvec h;
    std::memcpy(&h, p, sizeof h);
    const uvec bits = __builtin_convertvector(h, uvec) << 16;  // bfloat16 is float32's top half
    vec v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  } else {
#if defined(__AVX512F__)
    static_assert(VW == 16, "16-float vectors under AVX-512");
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    vec out;
    std::memcpy(&out, &v, sizeof out);
    return out;
#elif defined(__F16C__)
    static_assert(VW == 8, "8-float vectors under AVX2");
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    vec out;
    std::memcpy(&out, &v, sizeof out);
    return out;
#elif defined(DGPP_FLOAT16_VECTORS)
    fvec16 h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vec);
#else
    vec v;
    const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
    for (int i = 0; i < VW; ++i) v[i] = static_cast<float>(c10::Half(q[i], c10::Half::from_bits()));
    return v;
#endif
  }
}

template <int64_t kind>
inline float weight_at(const uint8_t* row, int64_t k) {
  if constexpr (kind == F32) return reinterpret_cast<const float*>(row)[k];
  const uint16_t bits = reinterpret_cast<const uint16_t*>(row)[k];
  if constexpr (kind == BF16) return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Rows n0 .. n1 of y [MB, ldy] = x [MB, K] W^T for dense W (row_bytes apart), MB <= 8. One or
// two rows of x take four rows of W a step: four streams from memory and four accumulation
// chains in flight (one row at a time left float32 weights well below the memory's rate).
// How far ahead of the weights being read each row's are prefetched (as in ggml_gemv.h): on the
// default model's products, one thread, float16 1.2-1.3x with one row of x and 1.7x with eight,
// float32 1.6x with eight and even with one (it already streams at the memory's rate); 512 B
// and 1 KiB gave less.
constexpr int64_t PREFETCH = 2048;

template <int64_t kind, int MB>
void dense_chunk(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0,
                 int64_t n1, float* y, int64_t ldy) {
  constexpr int64_t size = kind == F32 ? 4 : 2;
  constexpr int RB = MB <= 2 ? 4 : 1;
  const int64_t full = K / VW * VW;
  int64_t n = n0;
  for (; n + RB <= n1; n += RB) {
    vec acc[RB][MB];
    for (int r = 0; r < RB; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = vec{};
    for (int64_t k = 0; k < full; k += VW) {
      vec xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = dgpp_tile::load(x + m * K + k);
      for (int r = 0; r < RB; ++r) {
        const uint8_t* at = w + (n + r) * row_bytes + k * size;
        __builtin_prefetch(at + PREFETCH);
        const vec wv = load_weights<kind>(at);
        for (int m = 0; m < MB; ++m) acc[r][m] += wv * xv[m];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int m = 0; m < MB; ++m) {
        float s = dgpp_tile::hsum(acc[r][m]);
        const uint8_t* row = w + (n + r) * row_bytes;
        for (int64_t k = full; k < K; ++k) s += weight_at<kind>(row, k) * x[m * K + k];
        y[m * ldy + n + r] = s;
      }
  }
  for (; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    vec acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = vec{};
    for (int64_t k = 0; k < full; k += VW) {
      const vec wv = load_weights<kind>(row + k * size);
      for (int m = 0; m < MB; ++m) acc[m] += wv * dgpp_tile::load(x + m * K + k);
    }
    for (int m = 0; m < MB; ++m) {
      float s = dgpp_tile::hsum(acc[m]);
      for (int64_t k = full; k < K; ++k) s += weight_at<kind>(row, k) * x[m * K + k];
      y[m * ldy + n] = s;
    }
  }
}

template <int64_t kind>
void dense_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                int64_t n0, int64_t n1, float* y, int64_t ldy) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const float* xc = x + m0 * K;
    float* yc = y + m0 * ldy;
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: dense_chunk<kind, 1>(xc, K, w, row_bytes, n0, n1, yc, ldy); break;
      case 2: dense_chunk<kind, 2>(xc, K, w, row_bytes, n0, n1, yc, ldy); break;
      case 3: dense_chunk<kind, 3>(xc, K, w, row_bytes, n0, n1, yc, ldy); break;
      case 4: dense_chunk<kind, 4>(xc, K, w, row_bytes, n0, n1, yc, ldy); break;
      case 5: dense_chunk<kind, 5>(xc, K, w, row_bytes, n0, n1, yc, ldy); break;
      case 6: dense_chunk<kind, 6>(xc, K, w, row_bytes, n0, n1, yc, ldy); break;
      case 7: dense_chunk<kind, 7>(xc, K, w, row_bytes, n0, n1, yc, ldy); break;
      default: dense_chunk<kind, 8>(xc, K, w, row_bytes, n0, n1, yc, ldy); break;
    }
  }
}

}  // namespace dgpp_dense
