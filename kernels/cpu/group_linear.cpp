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
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DGPP_AVX2 1
#endif

namespace {

// The packed weight as the kernels read it; every tensor checked and contiguous.
struct Packed {
  const uint8_t* codes;
  int64_t row_bytes;
  const void* scales;
  at::ScalarType scale_type;
  const uint8_t* zeros;  // nullptr: no zero codes
  const float* lut;
  int64_t bits, G, K, groups;
  const float* global;  // nullptr: none
  bool global_per_row;  // global[r], else global[0] for every row
  int64_t global_mode;  // 0 none, 1 divide, 2 multiply

  // Effective scales of rows r0 .. r1 into out[(r1 - r0) * groups] (rows are contiguous): the
  // dtype switch outside the loops, the conversion vectorized; one call per block of rows keeps
  // the per-row overhead off short rows (K = 576 is 36 chunks of 16 weights).
  void scale_rows(int64_t r0, int64_t r1, float* out) const {
    const int64_t base = r0 * groups, count = (r1 - r0) * groups;
    if (scale_type == at::kFloat) {
      std::memcpy(out, static_cast<const float*>(scales) + base, count * sizeof(float));
    } else if (scale_type == at::kHalf) {
      const uint16_t* s = static_cast<const uint16_t*>(scales) + base;
      int64_t i = 0;
#ifdef DGPP_AVX2
      for (; i + 8 <= count; i += 8)  // F16C, 8 at a time
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(s + i))));
      for (; i < count; ++i) out[i] = _cvtsh_ss(s[i]);
#endif
      for (; i < count; ++i) out[i] = static_cast<float>(c10::Half(s[i], c10::Half::from_bits()));
    } else {  // bfloat16: the high half of a float32, which the compiler vectorizes
      const uint16_t* s = static_cast<const uint16_t*>(scales) + base;
      for (int64_t i = 0; i < count; ++i) {
        const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
        std::memcpy(out + i, &bits, 4);
      }
    }
    if (global_mode == 0) return;
    for (int64_t r = r0; r < r1; ++r) {
      const float gs = global[global_per_row ? r : 0];
      float* o = out + (r - r0) * groups;
      if (global_mode == 1) {
        for (int64_t g = 0; g < groups; ++g) o[g] = o[g] / gs;
      } else {
        for (int64_t g = 0; g < groups; ++g) o[g] = o[g] * gs;
      }
    }
  }
  // Zero codes of rows r0 .. r1 as floats (all 0 without zero codes).
  void zero_rows(int64_t r0, int64_t r1, float* out) const {
    const int64_t count = (r1 - r0) * groups;
    if (zeros == nullptr) {
      std::fill(out, out + count, 0.0f);
    } else {
      for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(zeros[r0 * groups + i]);
    }
  }
};

uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

// The e4m3 code b as float16 bits whose value is e4m3(b) / 256 (NaN codes 0x7F, 0xFF: NaN).
uint16_t e4m3_half_bits(uint32_t b) {
  const uint32_t em = b & 0x7F;
  uint32_t h = (em << 7) | ((b & 0x80) << 8);
  if (em == 0x7F) h |= 0x7E00;
  return static_cast<uint16_t>(h);
}

// Scalar decode of one group (the portable path and the reference for the AVX2 decoders).
void decode_group(const Packed& p, const uint8_t* row, int64_t g, float s, float z, float* w) {
  const int64_t c0 = g * p.G;
  if (p.bits == 4) {
    for (int64_t j = 0; j < p.G; j += 2) {
      const uint8_t byte = row[(c0 + j) / 2];
      w[j] = (p.lut[byte & 0x0F] - z) * s;
      w[j + 1] = (p.lut[byte >> 4] - z) * s;
    }
  } else {
    for (int64_t j = 0; j < p.G; ++j) w[j] = (p.lut[row[c0 + j]] - z) * s;
  }
}

void rows_portable(const Packed& p, const float* x, int64_t M, int64_t n0, int64_t n1, float* y,
                   int64_t N) {
  std::vector<float> w(p.G), srow(p.groups), zrow(p.groups), acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.codes + n * p.row_bytes;
    p.scale_rows(n, n + 1, srow.data());
    p.zero_rows(n, n + 1, zrow.data());
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t g = 0; g < p.groups; ++g) {
      decode_group(p, row, g, srow[g], zrow[g], w.data());
      for (int64_t m = 0; m < M; ++m) {
        const float* xg = x + m * p.K + g * p.G;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < p.G; ++j) s += w[j] * xg[j];
        acc[m] += s;
      }
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = acc[m];
  }
}

void dequant_rows_portable(const Packed& p, int64_t r0, int64_t r1, float* out) {
  std::vector<float> srow(p.groups), zrow(p.groups);
  for (int64_t r = r0; r < r1; ++r) {
    p.scale_rows(r, r + 1, srow.data());
    p.zero_rows(r, r + 1, zrow.data());
    for (int64_t g = 0; g < p.groups; ++g)
      decode_group(p, p.codes + r * p.row_bytes, g, srow[g], zrow[g],
                   out + (r - r0) * p.K + g * p.G);
  }
}

enum Kind { AFFINE4, SYM4, LUT4, E4M3, GATHER8 };

Kind classify(const Packed& p) {
  const float* lut = p.lut;
  if (p.bits == 8) {
    bool e4m3 = true;
    for (uint32_t b = 0; b < 256 && e4m3; ++b) {
      const float v = static_cast<float>(c10::Half(e4m3_half_bits(b), c10::Half::from_bits()));
      e4m3 = (b & 0x7F) == 0x7F ? lut[b] != lut[b] : bits_of(lut[b]) == bits_of(v * 256.0f);
    }
    return e4m3 ? E4M3 : GATHER8;
  }
  bool affine = lut[0] == static_cast<float>(static_cast<int32_t>(lut[0])) &&
                lut[0] > -1048576.0f && lut[0] < 1048576.0f;
  for (int i = 1; i < 16 && affine; ++i) affine = lut[i] == lut[0] + static_cast<float>(i);
  if (affine) return AFFINE4;
  bool sym = p.zeros == nullptr;
  for (int i = 0; i < 8 && sym; ++i) sym = bits_of(lut[i + 8]) == (bits_of(lut[i]) ^ 0x80000000u);
  return sym ? SYM4 : LUT4;
}

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
