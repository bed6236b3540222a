// AVX2 decoders and the register-path GEMV of kernels/cpu/group_linear.cpp (see its header
// comment). Included by group_linear.cpp only, after group_packed.h.
#pragma once

#include "group_packed.h"

namespace {
#ifdef DGPP_AVX2
// Decoders: begin(scale, zero) once per group, then decode16(p) -> the exact weights of the 16
// columns whose codes start at p (8 bytes of 4-bit codes, 16 of 8-bit ones) in two vectors.
inline __m256i nibbles8(const uint8_t* p) {  // the 8 codes of 4 bytes, column order, high bits left
  uint32_t u;
  std::memcpy(&u, p, 4);
  return _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(u)),
                           _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
}

struct Affine4 {  // (i + (lut[0] - z)) * s: exact, all terms are small integers until the scale
  static constexpr bool kFactored = true;
  float base;
  __m256 c, s;
  Affine4() = default;
  explicit Affine4(const Packed& p) : base(p.lut[0]) {}
  void factors(float scale, float zero, float& fs, float& fc) const {
    fs = scale;
    fc = base - zero;
  }
  void raw16(const uint8_t* p, __m256& v0, __m256& v1) const {
    const __m256i mask = _mm256_set1_epi32(0x0F);
    v0 = _mm256_cvtepi32_ps(_mm256_and_si256(nibbles8(p), mask));
    v1 = _mm256_cvtepi32_ps(_mm256_and_si256(nibbles8(p + 4), mask));
  }
  void begin(float scale, float zero) {
    c = _mm256_set1_ps(base - zero);
    s = _mm256_set1_ps(scale);
  }
  __m256 one(const uint8_t* p) const {
    const __m256i i = _mm256_and_si256(nibbles8(p), _mm256_set1_epi32(0x0F));
    return _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(i), c), s);
  }
  void decode16(const uint8_t* p, __m256& w0, __m256& w1) const {
    w0 = one(p);
    w1 = one(p + 4);
  }
};

struct Sym4 {  // lut[i] * s from the scaled table; codes 8-15 flip the sign (exact in IEEE)
  static constexpr bool kFactored = false;
  __m256 raw, table;
  Sym4() = default;
  explicit Sym4(const Packed& p) : raw(_mm256_loadu_ps(p.lut)) {}
  void begin(float scale, float) { table = _mm256_mul_ps(raw, _mm256_set1_ps(scale)); }
  __m256 one(const uint8_t* p) const {
    const __m256i i = nibbles8(p);
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(i, 28), _mm256_set1_epi32(INT32_MIN));
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(table, i), _mm256_castsi256_ps(sign));
  }
  void decode16(const uint8_t* p, __m256& w0, __m256& w1) const {
    w0 = one(p);
    w1 = one(p + 4);
  }
};

struct Lut4 {  // (lut - z) * s for both halves of the table, selected by bit 3
  static constexpr bool kFactored = false;
  __m256 raw_lo, raw_hi, lo, hi;
  Lut4() = default;
  explicit Lut4(const Packed& p)
      : raw_lo(_mm256_loadu_ps(p.lut)), raw_hi(_mm256_loadu_ps(p.lut + 8)) {}
  void begin(float scale, float zero) {
    const __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero);
    lo = _mm256_mul_ps(_mm256_sub_ps(raw_lo, z), s);
    hi = _mm256_mul_ps(_mm256_sub_ps(raw_hi, z), s);
  }
  __m256 one(const uint8_t* p) const {
    const __m256i i = nibbles8(p);
    const __m256 a = _mm256_permutevar8x32_ps(lo, i), b = _mm256_permutevar8x32_ps(hi, i);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
  }
  void decode16(const uint8_t* p, __m256& w0, __m256& w1) const {
    w0 = one(p);
    w1 = one(p + 4);
  }
};

// (v / 256 - z / 256) * (256 s) == (v - z) * s exactly: powers of two commute with rounding here
// (the smallest nonzero |v - z| / 256 is 2^-17, far from float32's subnormals).
struct E4m3 {
  static constexpr bool kFactored = true;
  __m256 s, z;
  E4m3() = default;
  explicit E4m3(const Packed&) {}
  void begin(float scale, float zero) {
    s = _mm256_set1_ps(scale * 256.0f);
    z = _mm256_set1_ps(zero * (1.0f / 256.0f));
  }
  void factors(float scale, float zero, float& fs, float& fc) const {
    fs = scale * 256.0f;
    fc = -zero * (1.0f / 256.0f);
  }
  // The 16 codes' values / 256: each code's 7 low bits placed as a float16's exponent and
  // mantissa (e4m3's bias 7 against float16's 15 is the factor 2^-8, subnormals included).
  void raw16(const uint8_t* p, __m256& v0, __m256& v1) const {
    const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i em = _mm256_and_si256(h, _mm256_set1_epi16(0x7F));
    __m256i f = _mm256_or_si256(_mm256_slli_epi16(em, 7),
                                _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8));
    const __m256i nan = _mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x7F));
    f = _mm256_or_si256(f, _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)));
    v0 = _mm256_cvtph_ps(_mm256_castsi256_si128(f));
    v1 = _mm256_cvtph_ps(_mm256_extracti128_si256(f, 1));
  }
  void decode16(const uint8_t* p, __m256& w0, __m256& w1) const {
    __m256 v0, v1;
    raw16(p, v0, v1);
    w0 = _mm256_mul_ps(_mm256_sub_ps(v0, z), s);
    w1 = _mm256_mul_ps(_mm256_sub_ps(v1, z), s);
  }
};

struct Gather8 {  // any 256-entry table
  static constexpr bool kFactored = false;
  const float* lut;
  __m256 s, z;
  Gather8() = default;
  explicit Gather8(const Packed& p) : lut(p.lut) {}
  void begin(float scale, float zero) {
    s = _mm256_set1_ps(scale);
    z = _mm256_set1_ps(zero);
  }
  void decode16(const uint8_t* p, __m256& w0, __m256& w1) const {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256 v0 = _mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(b), 4);
    const __m256 v1 = _mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)), 4);
    w0 = _mm256_mul_ps(_mm256_sub_ps(v0, z), s);
    w1 = _mm256_mul_ps(_mm256_sub_ps(v1, z), s);
  }
};

constexpr int64_t ROW_BLOCK = 64;  // rows whose scales and zeros are converted at once

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Output rows n0 .. n1 for MB (1-8) rows of x. MB <= 4: two accumulators (two FMA chains) per
// row of x, which one row of x needs to hide the FMA latency; MB > 4: one each, which keeps all
// of them in the 16 vector registers. (Decoding two output rows at once, for more chains at
// M = 1, measured slower: the second decoder's state no longer stays in registers.)
template <class D, int MB>
void rows_avx2(const D& proto, const Packed& p, const float* x, int64_t n0, int64_t n1, float* y,
               int64_t N, float* sblock, float* zblock, const float* xsum) {
  constexpr bool two = MB <= 4;
  constexpr bool factored = D::kFactored && MB <= 2;
  constexpr int NB = two ? MB : 1;
  const int64_t step = 2 * p.bits;  // code bytes per 16 weights
  D dec = proto;
  for (int64_t n = n0; n < n1; ++n) {
    if ((n - n0) % ROW_BLOCK == 0) {
      const int64_t end = std::min(n1, n + ROW_BLOCK);
      p.scale_rows(n, end, sblock);
      p.zero_rows(n, end, zblock);
    }
    const float* srow = sblock + (n - n0) % ROW_BLOCK * p.groups;
    const float* zrow = zblock + (n - n0) % ROW_BLOCK * p.groups;
    const uint8_t* pc = p.codes + n * p.row_bytes;
    if constexpr (factored) {
      __m256 tot[MB];
      float offset[MB];
      for (int m = 0; m < MB; ++m) tot[m] = _mm256_setzero_ps(), offset[m] = 0.0f;
      const float* xc = x;
      for (int64_t g = 0; g < p.groups; ++g) {
        float s, c;  // W = (v + c) * s
        dec.factors(srow[g], zrow[g], s, c);
        __m256 a[MB], b[MB];
        for (int m = 0; m < MB; ++m) a[m] = b[m] = _mm256_setzero_ps();
        for (int64_t j = 0; j < p.G; j += 16, pc += step, xc += 16) {
          __m256 v0, v1;
          dec.raw16(pc, v0, v1);
          for (int m = 0; m < MB; ++m) {
            a[m] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(xc + m * p.K), a[m]);
            b[m] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xc + m * p.K + 8), b[m]);
          }
        }
        const __m256 sv = _mm256_set1_ps(s);
        for (int m = 0; m < MB; ++m) {
          tot[m] = _mm256_fmadd_ps(sv, _mm256_add_ps(a[m], b[m]), tot[m]);
          offset[m] += s * c * xsum[m * p.groups + g];
        }
      }
      for (int m = 0; m < MB; ++m) y[m * N + n] = hsum(tot[m]) + offset[m];
      continue;
    }
    __m256 a[MB], b[NB];
    for (int m = 0; m < MB; ++m) a[m] = _mm256_setzero_ps();
    for (int m = 0; m < NB; ++m) b[m] = _mm256_setzero_ps();
    const float* xc = x;
    for (int64_t g = 0; g < p.groups; ++g) {
      dec.begin(srow[g], zrow[g]);
      // Pointers, not indices, in the hot loop: no index arithmetic per 16 weights.
      for (int64_t j = 0; j < p.G; j += 16, pc += step, xc += 16) {
        __m256 w0, w1;
        dec.decode16(pc, w0, w1);
        for (int m = 0; m < MB; ++m) {
          a[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xc + m * p.K), a[m]);
          if (two) {
            b[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xc + m * p.K + 8), b[m]);
          } else {
            a[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xc + m * p.K + 8), a[m]);
          }
        }
      }
    }
    for (int m = 0; m < MB; ++m) y[m * N + n] = hsum(two ? _mm256_add_ps(a[m], b[m]) : a[m]);
  }
}

// Rows of x in chunks of up to 8; each chunk decodes W once.
template <class D>
void gemv_avx2(const Packed& p, const float* x, int64_t M, float* y, int64_t N) {
  const D dec(p);
  std::vector<float> xsum(D::kFactored ? M * p.groups : 0);  // per row of x and group
  for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) {
    float t = 0.0f;
    for (int64_t j = 0; j < p.G; ++j) t += x[i * p.G + j];
    xsum[i] = t;
  }
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> sb(ROW_BLOCK * p.groups), zb(ROW_BLOCK * p.groups);
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const float* xm = x + m0 * p.K;
      const float* xs = xsum.data() + m0 * p.groups;
      float* ym = y + m0 * N;
      switch (std::min<int64_t>(8, M - m0)) {
        case 1: rows_avx2<D, 1>(dec, p, xm, n0, n1, ym, N, sb.data(), zb.data(), xs); break;
        case 2: rows_avx2<D, 2>(dec, p, xm, n0, n1, ym, N, sb.data(), zb.data(), xs); break;
        case 3: rows_avx2<D, 3>(dec, p, xm, n0, n1, ym, N, sb.data(), zb.data(), xs); break;
        case 4: rows_avx2<D, 4>(dec, p, xm, n0, n1, ym, N, sb.data(), zb.data(), xs); break;
        case 5: rows_avx2<D, 5>(dec, p, xm, n0, n1, ym, N, sb.data(), zb.data(), xs); break;
        case 6: rows_avx2<D, 6>(dec, p, xm, n0, n1, ym, N, sb.data(), zb.data(), xs); break;
        case 7: rows_avx2<D, 7>(dec, p, xm, n0, n1, ym, N, sb.data(), zb.data(), xs); break;
        default: rows_avx2<D, 8>(dec, p, xm, n0, n1, ym, N, sb.data(), zb.data(), xs);
      }
    }
  });
}

template <class D>
void dequant_rows_avx2(const Packed& p, int64_t r0, int64_t r1, float* out) {
  D dec(p);
  std::vector<float> srow(p.groups), zrow(p.groups);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* pc = p.codes + r * p.row_bytes;
    float* o = out + (r - r0) * p.K;
    p.scale_rows(r, r + 1, srow.data());
    p.zero_rows(r, r + 1, zrow.data());
    for (int64_t g = 0; g < p.groups; ++g) {
      dec.begin(srow[g], zrow[g]);
      for (int64_t j = 0; j < p.G; j += 16, pc += 2 * p.bits, o += 16) {
        __m256 w0, w1;
        dec.decode16(pc, w0, w1);
        _mm256_storeu_ps(o, w0);
        _mm256_storeu_ps(o + 8, w1);
      }
    }
  }
}
#endif
}  // namespace
