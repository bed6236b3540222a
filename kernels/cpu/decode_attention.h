// Attention of decode rows (one query each) over the paged KV cache, read in place through the
// block tables, float32 with a max-subtracted softmax like the PyTorch twin's
// (`paged_attention_torch`), up to summation order and a polynomial exp (vec_math.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include "tile_gemm.h"
#include "vec_math.h"

namespace dgpp_decode {

using dgpp_tile::vec;
using dgpp_tile::VW;

inline float dot(const float* a, const float* b, int64_t D) {
  vec acc = vec{};
  int64_t d = 0;
  for (; d + VW <= D; d += VW) acc += dgpp_tile::load(a + d) * dgpp_tile::load(b + d);
  float s = dgpp_tile::hsum(acc);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// An int8 KV cache's rows (`kernels/kv_quant.py`, `int8`): each head of D values is D / 32 of
// ggml's Q8_0 blocks, a float16 scale d and 32 int8 codes: value = d * code.
constexpr int64_t Q8_BLOCK = 32, Q8_BYTES = 34;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

typedef int8_t cvec __attribute__((vector_size(VW)));  // VW int8 codes

// VW codes as floats (one vector load, one widening conversion).
inline vec codes_at(const int8_t* p) {
  cvec c;
  std::memcpy(&c, p, sizeof c);
  return __builtin_convertvector(c, vec);
}

// A Q8_0 row of D values into out [D] (float32), a vector at a time: a decode span converts
// each cached row once for every query head of its group, then runs the float loops.
inline void decode_q8(const uint8_t* row, int64_t D, float* out) {
  for (int64_t b = 0; b < D / Q8_BLOCK; ++b) {
    const uint8_t* block = row + b * Q8_BYTES;
    const int8_t* code = reinterpret_cast<const int8_t*>(block + 2);
    const vec d = dgpp_tile::splat(half_at(block));
    for (int64_t i = 0; i < Q8_BLOCK; i += VW) {
      const vec x = d * codes_at(code + i);
      std::memcpy(out + b * Q8_BLOCK + i, &x, sizeof x);
    }
  }
}

// x [D] as Q8_0 blocks into out [D / 32 * 34]: d = max|x| / 127, codes roundf(x / d) computed
// with the float32 d, d kept as float16 (ggml's quantize_row_q8_0, the twin's `KvFormat.encode`).
inline void store_q8(const float* x, int64_t D, uint8_t* out) {
  for (int64_t b = 0; b < D / Q8_BLOCK; ++b) {
    const float* xb = x + b * Q8_BLOCK;
    float top = 0.0f;
    for (int64_t i = 0; i < Q8_BLOCK; ++i) top = std::max(top, std::fabs(xb[i]));
    const float d = top / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t* block = out + b * Q8_BYTES;
    const uint16_t bits = c10::detail::fp16_ieee_from_fp32_value(d);
    std::memcpy(block, &bits, sizeof bits);
    int8_t* code = reinterpret_cast<int8_t*>(block + 2);
    for (int64_t i = 0; i < Q8_BLOCK; ++i) code[i] = static_cast<int8_t>(std::roundf(xb[i] * inverse));
  }
}

// An fp8_e4m3 cache's rows (`kernels/kv_quant.py`, `fp8_e4m3`): each head of D values is one
// float16 scale d = max|x| / 448 and D e4m3 codes: value = d * code.
inline const float* fp8_values() {  // every e4m3 byte's value, built once
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int c = 0; c < 256; ++c)
      t[c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

inline void decode_fp8(const uint8_t* row, int64_t D, float* out) {
  const float d = half_at(row), *values = fp8_values();
  for (int64_t i = 0; i < D; ++i) out[i] = d * values[row[2 + i]];
}

// x [D] as a float16 scale and e4m3 codes of x / d, d = max|x| / 448 in float32, the codes by
// c10's float-to-e4m3 conversion (round to nearest even): the twin's `KvFormat.encode`.
inline void store_fp8(const float* x, int64_t D, uint8_t* out) {
  float top = 0.0f;
  for (int64_t i = 0; i < D; ++i) top = std::max(top, std::fabs(x[i]));
  const float d = top / 448.0f, inverse = d == 0.0f ? 0.0f : 1.0f / d;
  const uint16_t bits = c10::detail::fp16_ieee_from_fp32_value(d);
  std::memcpy(out, &bits, sizeof bits);
  for (int64_t i = 0; i < D; ++i) out[2 + i] = c10::Float8_e4m3fn(x[i] * inverse).x;
}

// What a cache stores (`kernels/kv_quant.py`): float32 rows, int8 (Q8_0) rows, fp8_e4m3 rows.
enum KvKind : int64_t { KV_F32 = 0, KV_Q8 = 1, KV_FP8 = 2 };

inline int64_t kv_row_bytes(int64_t kind, int64_t D) {
  return kind == KV_Q8 ? D / Q8_BLOCK * Q8_BYTES : kind == KV_FP8 ? D + 2 : D * 4;
}

inline void decode_row(int64_t kind, const uint8_t* row, int64_t D, float* out) {
  if (kind == KV_Q8) decode_q8(row, D, out);
  else decode_fp8(row, D, out);
}

inline void store_row(int64_t kind, const float* x, int64_t D, uint8_t* out) {
  if (kind == KV_Q8) store_q8(x, D, out);
  else store_fp8(x, D, out);
}

// How many positions ahead of the one being scored its keys and values are prefetched: a decode
// row's positions sit in scattered blocks that the weights streamed since the last step have
// pushed out of L2.
constexpr int64_t AHEAD = 4;

struct Attention {
  const float *q, *kc, *vc;  // q [B, H, D]; caches [blocks * block_size, H_kv, D] (float32)
  const int64_t *table, *lens;
  int64_t width, block_size, heads, kv_heads, D;
  float scale;
  const uint8_t *kq = nullptr, *vq = nullptr;  // quantized caches instead: [.., H_kv, row bytes]
  int64_t kind = KV_F32;                         // what kq and vq hold (KvKind)
};

// One span of a decode row's keys, p0 .. p1, for the query heads of KV head g: the unnormalized
// sum of e^(s - top) v into acc [group, D], top and the sum of e^(s - top) into m and l [group].
void attend_span(const Attention& a, int64_t b, int64_t g, int64_t p0, int64_t p1, float* acc,
                 float* m, float* l, std::vector<float>& scores, std::vector<int64_t>& where) {
  const bool q8 = a.kq != nullptr;  // quantized rows (int8 or fp8)
  const int64_t row = q8 ? kv_row_bytes(a.kind, a.D) : a.D;  // one head's elements (or bytes)
  const int64_t group = a.heads / a.kv_heads, ld = a.kv_heads * row, D = a.D, n = p1 - p0;
  const int64_t padded = (n + VW - 1) / VW * VW;
  const int64_t* table = a.table + b * a.width;
  const float* qg = a.q + (b * a.heads + g * group) * D;
  scores.resize(group * padded + D);
  float* const row_scratch = scores.data() + group * padded;  // one decoded quantized row
  // each key's row in the caches, walked block by block (no division per key)
  std::vector<int64_t>& rows = where;
  rows.resize(n);
  for (int64_t p = p0, i = 0; p < p1; ++i) {
    const int64_t block = p / a.block_size, in = p % a.block_size;
    const int64_t take = std::min(a.block_size - in, p1 - p), base = table[block] * a.block_size + in;
    for (int64_t j = 0; j < take; ++j) rows[i + j] = (base + j) * ld + g * row;
    p += take;
    i += take - 1;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (q8) {
      if (i + AHEAD < n)
        for (int64_t d = 0; d < row; d += 64) {
          __builtin_prefetch(a.kq + rows[i + AHEAD] + d);
          __builtin_prefetch(a.vq + rows[i + AHEAD] + d);
        }
      decode_row(a.kind, a.kq + rows[i], D, row_scratch);
      const float* k = row_scratch;
      for (int64_t h = 0; h < group; ++h) scores[h * padded + i] = dot(qg + h * D, k, D) * a.scale;
      continue;
    }
    if (i + AHEAD < n) {  // the keys a few positions on, and their values for the second pass
      for (int64_t d = 0; d < D; d += 16) {
        __builtin_prefetch(a.kc + rows[i + AHEAD] + d);
        __builtin_prefetch(a.vc + rows[i + AHEAD] + d);
      }
    }
    const float* k = a.kc + rows[i];
    for (int64_t h = 0; h < group; ++h) scores[h * padded + i] = dot(qg + h * D, k, D) * a.scale;
  }
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores.data() + h * padded;
    const float top = *std::max_element(s, s + n);
    vec total = vec{};
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
      const vec e = dgpp_tile::vexp(dgpp_tile::load(s + i) - top);
      std::memcpy(s + i, &e, sizeof e);
      total += e;
    }
    float rest = 0.0f;
    for (; i < n; ++i) rest += s[i] = std::exp(s[i] - top);
    m[h] = top;
    l[h] = dgpp_tile::hsum(total) + rest;
    std::fill(acc + h * D, acc + (h + 1) * D, 0.0f);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (q8) decode_row(a.kind, a.vq + rows[i], D, row_scratch);
    const float* v = q8 ? row_scratch : a.vc + rows[i];
    for (int64_t h = 0; h < group; ++h) {
      float* o = acc + h * D;
      const float w = scores[h * padded + i];
      int64_t d = 0;
      for (; d + VW <= D; d += VW) {
        const vec sum = dgpp_tile::load(o + d) + w * dgpp_tile::load(v + d);
        std::memcpy(o + d, &sum, sizeof sum);
      }
      for (; d < D; ++d) o[d] += w * v[d];
    }
  }
}

// out [B, H, D] = softmax(q k^T * scale) v for B decode rows over their cached positions,
// float32 and max-subtracted like the twin's. Each (row, KV head) is cut into spans of keys so
// every thread has work (a single row's few KV heads would leave threads idle); each key and
// value is read once for its group of query heads; the spans are merged by their maxima.
void decode_attention(const Attention& a, int64_t B, float* out) {
  const int64_t group = a.heads / a.kv_heads, D = a.D;
  struct Span { int64_t b, g, p0, p1, first, count; };
  std::vector<Span> spans;
  const int64_t want = 4 * at::get_num_threads(), pairs = B * a.kv_heads;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < a.kv_heads; ++g) {
      const int64_t n = a.lens[b];
      const int64_t cuts = std::max<int64_t>(1, std::min((want + pairs - 1) / pairs, n / 64));
      const int64_t len = (n + cuts - 1) / cuts, first = static_cast<int64_t>(spans.size());
      for (int64_t p0 = 0; p0 < n; p0 += len)
        spans.push_back({b, g, p0, std::min(n, p0 + len), first, (n + len - 1) / len});
    }
  const int64_t S = static_cast<int64_t>(spans.size());
  std::vector<float> acc(S * group * D), m(S * group), l(S * group);
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> scores;
    std::vector<int64_t> where;
    for (int64_t s = s0; s < s1; ++s) {
      const Span& sp = spans[s];
      attend_span(a, sp.b, sp.g, sp.p0, sp.p1, acc.data() + s * group * D, m.data() + s * group,
                  l.data() + s * group, scores, where);
    }
  });
  for (const Span& sp : spans) {
    if (sp.p0 != 0) continue;  // each (row, KV head) once, from its first span
    for (int64_t h = 0; h < group; ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = sp.first; s < sp.first + sp.count; ++s) top = std::max(top, m[s * group + h]);
      float total = 0.0f;
      float* o = out + (sp.b * a.heads + sp.g * group + h) * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t s = sp.first; s < sp.first + sp.count; ++s) {
        const float w = std::exp(m[s * group + h] - top);
        total += w * l[s * group + h];
        const float* as = acc.data() + (s * group + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * as[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= total;
    }
  }
}

}  // namespace dgpp_decode
