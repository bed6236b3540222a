// GGML block decoding and the decode-sized product over it (fewer rows of x than the tile GEMM
// takes), shared by the linear kernel (ggml_linear.cpp) and the fused decode step
// (decoder_step.cpp): each thread takes a range of output rows, decodes each 32-weight block once
// into float registers and multiplies it with up to 8 rows of x in float32 (the same arithmetic
// as dequantize-then-F.linear, up to summation order). Where the compiler targets AVX2 (and
// AVX-512) the block decoders use intrinsics; elsewhere plain C++ for the auto-vectorizer
// (-O3 -march=native: NEON on Arm).
#pragma once

#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __F16C__
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DGPP_AVX2 1
#endif

namespace dgpp_ggml {

constexpr int64_t QK = 32;
enum Format : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; the conversion is exact either way
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline int64_t type_size(int64_t format) {
  switch (format) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
  }
  TORCH_CHECK(false, "unsupported GGML format ", format);
}

// One block's 32 weights as floats, exactly as ggml_blocks' dequantizers compute them (Q4_0 is
// d * (q - 8), not d * q - 8 d).
inline void dequant_block(int64_t format, const uint8_t* block, float* out) {
  const float d = half_at(block);
  if (format == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(q[j]) * d;
  } else if (format == Q4_0) {
    const uint8_t* qs = block + 2;
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>(static_cast<int>(qs[j] & 0x0F) - 8);
      out[j + 16] = d * static_cast<float>(static_cast<int>(qs[j] >> 4) - 8);
    }
  } else {
    const float m = half_at(block + 2);
    const uint8_t* qs = block + 4;
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
      out[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
}

#ifdef DGPP_AVX2
// The 32 codes of a block as four vectors of 8 floats: Q4 codes (0..15, low nibbles then high
// ones) or Q8 codes (-128..127).
inline void codes_avx2(int64_t format, const uint8_t* block, __m256 q[4]) {
  if (format == Q8_0) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    return;
  }
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (format == Q4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block's 32 weights as floats from its codes: Q4_1 d * q + m, Q4_0 d * (q - 8), Q8_0 d * q.
inline void dequant_block_avx2(int64_t format, const uint8_t* block, float* out) {
#ifdef __AVX512F__
  if (format != Q8_0) {  // 16 lanes: the low nibbles, then the high ones
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (format == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
    const __m512 d = _mm512_set1_ps(half_at(block));
    if (format == Q4_1) {
      const __m512 m = _mm512_set1_ps(half_at(block + 2));
      lo = _mm512_add_ps(_mm512_mul_ps(d, lo), m);
      hi = _mm512_add_ps(_mm512_mul_ps(d, hi), m);
    } else {
      const __m512 eight = _mm512_set1_ps(8.0f);
      lo = _mm512_mul_ps(d, _mm512_sub_ps(lo, eight));
      hi = _mm512_mul_ps(d, _mm512_sub_ps(hi, eight));
    }
    _mm512_storeu_ps(out, lo);
    _mm512_storeu_ps(out + 16, hi);
    return;
  }
#endif
  __m256 q[4];
  codes_avx2(format, block, q);
  const __m256 d = _mm256_set1_ps(half_at(block));
  if (format == Q4_1) {
    const __m256 m = _mm256_set1_ps(half_at(block + 2));
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_add_ps(_mm256_mul_ps(d, q[i]), m));
  } else {
    const __m256 shift = _mm256_set1_ps(format == Q4_0 ? 8.0f : 0.0f);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(d, _mm256_sub_ps(q[i], shift)));
  }
}

// Rows n0 .. n1 of y for MB <= 8 rows of x (one chunk): y = sum over blocks of d * (q . x) +
// offset * sum(x), where w = d * q + offset (Q4_1: offset m; Q4_0: -8 d; Q8_0: 0). Each block is
// decoded once for the chunk's rows; the accumulators stay in registers (MB is a constant).
template <int MB>
void gemv_chunk_avx2(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes,
                     int64_t format, int64_t ts, int64_t n0, int64_t n1, float* y, int64_t N,
                     const float* xsum) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MB];
    float offset_acc[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_setzero_ps();
      offset_acc[m] = 0.0f;
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* block = row + b * ts;
      const float d = half_at(block);
      const float offset = format == Q4_1 ? half_at(block + 2) : (format == Q4_0 ? -8.0f * d : 0.0f);
      __m256 q[4];
      codes_avx2(format, block, q);
      const __m256 dv = _mm256_set1_ps(d);
      for (int m = 0; m < MB; ++m) {
        const float* xb = x + m * K + b * QK;
        __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
        t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), t);
        t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t);
        t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), t);
        acc[m] = _mm256_fmadd_ps(dv, t, acc[m]);
        offset_acc[m] += offset * xsum[m * nb + b];
      }
    }
    for (int m = 0; m < MB; ++m) y[m * N + n] = hsum(acc[m]) + offset_acc[m];
  }
}

#ifdef __AVX512F__
// A block's 32 weights as two 16-float vectors (weights 0-15, then 16-31): Q4_1 d * q + m,
// Q4_0 d * (q - 8), Q8_0 d * q.
template <int64_t FMT>
inline void block_weights_avx512(const uint8_t* block, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(half_at(block));
  if constexpr (FMT == Q8_0) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))));
    return;
  }
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (FMT == Q4_1 ? 4 : 2)));
  lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
  // Q4_0: d * q - 8 d is d * (q - 8) exactly, rounded once as the product is. Q4_1: d * q + m
  // in one FMA (rounded once where the dequantizer rounds twice: at most half an ulp of the
  // weight apart, well inside the products' summation-order differences).
  const __m512 offset = FMT == Q4_1 ? _mm512_set1_ps(half_at(block + 2)) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
  lo = _mm512_fmadd_ps(d, lo, offset);
  hi = _mm512_fmadd_ps(d, hi, offset);
}

// How far ahead of the block being decoded its weights are fetched into L1: the hardware
// prefetcher alone left one core at 4.4 GB/s on the default model's products with one row of x;
// 2 KiB ahead runs them 1.25-1.4x faster (one thread, weights beyond L2; 256 B gave nothing).
constexpr int64_t PREFETCH = 2048;

// gemv_chunk_avx2 with 16-float vectors and the format a constant: each block's weights are
// decoded once (as the dequantizer computes them) and meet every row of x in two FMAs; one or two
// rows take two blocks a step, so enough accumulation chains are in flight; the weights 2 KiB
// ahead are prefetched.
template <int64_t FMT, int MB>
void gemv_chunk_avx512(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0,
                       int64_t n1, float* y, int64_t N) {
  constexpr int64_t ts = FMT == Q8_0 ? 34 : FMT == Q4_1 ? 20 : 18;
  constexpr int U = MB <= 2 ? 2 : 1;
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[U][MB][2];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MB; ++m) acc[u][m][0] = acc[u][m][1] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + U <= nb; b += U)
      for (int u = 0; u < U; ++u) {
        __m512 lo, hi;
        _mm_prefetch(reinterpret_cast<const char*>(row + (b + u) * ts + PREFETCH), _MM_HINT_T0);
        block_weights_avx512<FMT>(row + (b + u) * ts, lo, hi);
        for (int m = 0; m < MB; ++m) {
          const float* xb = x + m * K + (b + u) * QK;
          acc[u][m][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[u][m][0]);
          acc[u][m][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[u][m][1]);
        }
      }
    for (; b < nb; ++b) {
      __m512 lo, hi;
      block_weights_avx512<FMT>(row + b * ts, lo, hi);
      for (int m = 0; m < MB; ++m) {
        const float* xb = x + m * K + b * QK;
        acc[0][m][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[0][m][0]);
        acc[0][m][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[0][m][1]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      __m512 s = _mm512_add_ps(acc[0][m][0], acc[0][m][1]);
      for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, _mm512_add_ps(acc[u][m][0], acc[u][m][1]));
      y[m * N + n] = _mm512_reduce_add_ps(s);
    }
  }
}

template <int MB>
void gemv_chunk_wide(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t format,
                     int64_t n0, int64_t n1, float* y, int64_t N) {
  switch (format) {
    case Q4_0: gemv_chunk_avx512<Q4_0, MB>(x, K, w, row_bytes, n0, n1, y, N); break;
    case Q4_1: gemv_chunk_avx512<Q4_1, MB>(x, K, w, row_bytes, n0, n1, y, N); break;
    default: gemv_chunk_avx512<Q8_0, MB>(x, K, w, row_bytes, n0, n1, y, N); break;
  }
}
#define DGPP_GEMV_CHUNK(MB) gemv_chunk_wide<MB>(xc, K, w, row_bytes, format, n0, n1, yc, N)
constexpr bool USES_BLOCK_SUMS = false;  // the 16-float path folds each block's offset in
#else
#define DGPP_GEMV_CHUNK(MB) gemv_chunk_avx2<MB>(xc, K, w, row_bytes, format, ts, n0, n1, yc, N, sc)
constexpr bool USES_BLOCK_SUMS = true;  // whether gemv_rows_avx2 reads x's block sums
#endif

// Rows n0 .. n1 of y for any M: the rows of x in chunks of up to 8.
inline void gemv_rows_avx2(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                    int64_t format, int64_t ts, int64_t n0, int64_t n1, float* y, int64_t N,
                    const float* xsum) {
  const int64_t nb = K / QK;
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const float* xc = x + m0 * K;
    const float* sc = xsum + m0 * nb;
    float* yc = y + m0 * N;
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: DGPP_GEMV_CHUNK(1); break;
      case 2: DGPP_GEMV_CHUNK(2); break;
      case 3: DGPP_GEMV_CHUNK(3); break;
      case 4: DGPP_GEMV_CHUNK(4); break;
      case 5: DGPP_GEMV_CHUNK(5); break;
      case 6: DGPP_GEMV_CHUNK(6); break;
      case 7: DGPP_GEMV_CHUNK(7); break;
      default: DGPP_GEMV_CHUNK(8); break;
    }
  }
}
#endif

inline void gemv_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
               int64_t format, int64_t ts, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t nb = K / QK;
  alignas(64) float wf[32];
  std::vector<float> acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      dequant_block(format, row + b * ts, wf);
      for (int64_t m = 0; m < M; ++m) {
        const float* xb = x + m * K + b * QK;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < 32; ++j) s += wf[j] * xb[j];
        acc[m] += s;
      }
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = acc[m];
  }
}


// Per-block sums of the rows of x [M, K] (the offset term of gemv_rows_avx2): out [M, K / 32].
inline void block_sums(const float* x, int64_t M, int64_t K, float* out) {
  const int64_t nb = K / QK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.0f;
      for (int j = 0; j < 32; ++j) s += x[m * K + b * QK + j];
      out[m * nb + b] = s;
    }
}

}  // namespace dgpp_ggml
