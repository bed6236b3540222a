// The packed weight as kernels/cpu/group_linear.cpp reads it, and its scalar decoders
// (the portable path, and the reference the AVX2 decoders of group_decoders_avx2.h follow).
// Included by group_linear.cpp only.
#pragma once

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

}  // namespace
