// Causal attention of a prefill chunk over its sequence's paged KV cache, the cache read in
// place through the block table (no gather of the context into a contiguous copy).
//
// Work items: (KV head, tile of queries, span of keys). A tile is the queries x the KV head's
// group of query heads, up to ROWS rows, transposed so that rows lie along vector lanes: the
// scores of one key for every row are one FMA chain over the head dimension with the key's
// elements broadcast, the running max, the exponentials and the sums of an online softmax are
// elementwise across keys, and P.V broadcasts each value element over the rows' probabilities.
// No horizontal sums, no transposed copies of keys or values. A chunk with few items (a short
// chunk deep in a long context) splits its keys across threads and merges the spans by their
// log-sum-exp. The same arithmetic as the PyTorch twin (float32, max-subtracted softmax) up to
// summation order and a polynomial exp (Cephes' expf, relative error about 1e-7).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "tile_gemm.h"

namespace {

using dgpp_tile::load;
using dgpp_tile::vec;
using dgpp_tile::VW;
typedef int32_t ivec __attribute__((vector_size(VW * sizeof(int32_t))));

constexpr int RV_MAX = 3;              // row vectors per tile
constexpr int ROWS = RV_MAX * VW;      // 48 rows with AVX-512, 24 with 8-float vectors
constexpr int MAX_BLOCK = 64;          // cache block sizes up to this
#if defined(__AVX512F__)
constexpr int TB = 4;                  // keys per score microkernel: TB x RV accumulators
constexpr int DB = 8;                  // head dims per P.V microkernel: DB x RV accumulators
#else
constexpr int TB = 2;
constexpr int DB = 2;
#endif
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
inline vec splat(float x) { return vec{} + x; }

// e^x lane by lane (Cephes' expf); arguments below -87.3 give 2^-126, callers zero those lanes.
inline vec vexp(vec x) {
  x = x < splat(-87.3365447f) ? splat(-87.3365447f) : x;
  x = x > splat(88.3762626f) ? splat(88.3762626f) : x;
  const vec fx = x * 1.44269504088896341f + 0.5f;
  vec fn = __builtin_convertvector(__builtin_convertvector(fx, ivec), vec);
  fn = fn > fx ? fn - 1.0f : fn;  // floor
  x = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  const vec z = x * x;
  vec y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const ivec bits = (__builtin_convertvector(fn, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

struct Problem {
  const float* q;  // [Q, H, D]
  const float* k;  // [blocks, BS, Hkv, D]
  const float* v;
  const int64_t* table;
  float* out;  // [Q, H, D]
  int64_t Q, H, D, BS, Hkv, G, seq_len, QT, tiles, splits, split_len;
  float scale;
};

// Scores of tb keys (k: the first key's head, ldk apart) for every row: S[t][c] = k_t . q_rows.
template <int RV, int tb>
inline void scores(const float* qt, const float* k, int64_t ldk, int64_t D, vec (*S)[RV_MAX]) {
  vec a[tb][RV];
  for (int i = 0; i < tb; ++i)
    for (int c = 0; c < RV; ++c) a[i][c] = vec{};
  for (int64_t d = 0; d < D; ++d) {
    vec qv[RV];
    for (int c = 0; c < RV; ++c) qv[c] = load(qt + d * ROWS + c * VW);
    for (int i = 0; i < tb; ++i) {
      const float kd = k[i * ldk + d];
      for (int c = 0; c < RV; ++c) a[i][c] += kd * qv[c];
    }
  }
  for (int i = 0; i < tb; ++i)
    for (int c = 0; c < RV; ++c) S[i][c] = a[i][c];
}

// acc[d][rows] += sum over nt keys of v_t[d] * P[t][rows], for DB head dims from v's d0.
template <int RV>
inline void weighted_values(const vec (*P)[RV_MAX], int64_t nt, const float* v, int64_t ldk,
                            float* acc) {
  vec a[DB][RV];
  for (int e = 0; e < DB; ++e)
    for (int c = 0; c < RV; ++c) a[e][c] = load(acc + e * ROWS + c * VW);
  for (int64_t t = 0; t < nt; ++t) {
    vec p[RV];
    for (int c = 0; c < RV; ++c) p[c] = P[t][c];
    for (int e = 0; e < DB; ++e) {
      const float vd = v[t * ldk + e];
      for (int c = 0; c < RV; ++c) a[e][c] += vd * p[c];
    }
  }
  for (int e = 0; e < DB; ++e)
    for (int c = 0; c < RV; ++c) store(acc + e * ROWS + c * VW, a[e][c]);
}

// One work item: rows of (head h, tile) over the keys of `split`; leaves acc [D][ROWS] (not yet
// divided), m and l [ROWS] (running max and sum).
template <int RV>
void item(const Problem& p, int64_t h, int64_t tile, int64_t split, float* qt, float* acc,
          float* m_out, float* l_out) {
  const int64_t D = p.D, G = p.G, ldk = p.Hkv * D;
  const int64_t q0 = tile * p.QT, nq = std::min(p.QT, p.Q - q0), rows = nq * G;
  const int64_t first_pos = p.seq_len - p.Q + q0;
  alignas(64) float pos[ROWS];
  for (int64_t r = 0; r < RV * VW; ++r) {
    const bool real = r < rows;
    const int64_t i = r / G, head = h * G + r % G;
    pos[r] = static_cast<float>(real ? first_pos + i : first_pos);
    const float* qr = p.q + ((q0 + i) * p.H + head) * D;
    for (int64_t d = 0; d < D; ++d) qt[d * ROWS + r] = real ? qr[d] * p.scale : 0.0f;
  }
  std::fill(acc, acc + D * ROWS, 0.0f);
  vec m[RV], l[RV], qpos[RV];
  for (int c = 0; c < RV; ++c) {
    m[c] = splat(NEG_INF);
    l[c] = vec{};
    qpos[c] = load(pos + c * VW);
  }
  const int64_t last = first_pos + nq - 1;
  const int64_t k0 = split * p.split_len, k1 = std::min({p.seq_len, k0 + p.split_len, last + 1});
  vec S[MAX_BLOCK][RV_MAX];
  for (int64_t base = k0; base < k1; base += p.BS) {
    const int64_t nt = std::min(p.BS, k1 - base);
    const int64_t block = p.table[base / p.BS];
    const float* kb = p.k + (block * p.BS * p.Hkv + h) * D;
    const float* vb = p.v + (block * p.BS * p.Hkv + h) * D;
    int64_t t = 0;
    for (; t + TB <= nt; t += TB) scores<RV, TB>(qt, kb + t * ldk, ldk, D, S + t);
    for (; t < nt; ++t) scores<RV, 1>(qt, kb + t * ldk, ldk, D, S + t);
    vec block_max[RV];
    for (int c = 0; c < RV; ++c) block_max[c] = splat(NEG_INF);
    for (t = 0; t < nt; ++t) {
      const vec key_pos = splat(static_cast<float>(base + t));
      for (int c = 0; c < RV; ++c) {
        S[t][c] = qpos[c] < key_pos ? splat(NEG_INF) : S[t][c];
        block_max[c] = block_max[c] > S[t][c] ? block_max[c] : S[t][c];
      }
    }
    vec alpha[RV];
    for (int c = 0; c < RV; ++c) {
      const vec m_new = m[c] > block_max[c] ? m[c] : block_max[c];
      const vec safe = m_new == splat(NEG_INF) ? vec{} : m_new;  // rows that saw no key yet
      alpha[c] = m[c] == splat(NEG_INF) ? vec{} : vexp(m[c] - safe);
      vec sum = vec{};
      for (t = 0; t < nt; ++t) {
        const vec e = S[t][c] == splat(NEG_INF) ? vec{} : vexp(S[t][c] - safe);
        S[t][c] = e;
        sum += e;
      }
      l[c] = l[c] * alpha[c] + sum;
      m[c] = m_new;
    }
    for (int64_t d = 0; d < D; ++d)
      for (int c = 0; c < RV; ++c)
        store(acc + d * ROWS + c * VW, load(acc + d * ROWS + c * VW) * alpha[c]);
    for (int64_t d0 = 0; d0 < D; d0 += DB)
      weighted_values<RV>(S, nt, vb + d0, ldk, acc + d0 * ROWS);
  }
  for (int c = 0; c < RV; ++c) {
    store(m_out + c * VW, m[c]);
    store(l_out + c * VW, l[c]);
  }
}

// The rows of (h, tile) into the output: the spans' partial results weighed by e^(m - max).
void merge(const Problem& p, int64_t h, int64_t tile, const float* acc, const float* m,
           const float* l, int64_t stride) {
  const int64_t q0 = tile * p.QT, rows = std::min(p.QT, p.Q - q0) * p.G;
  std::vector<float> w(p.splits);
  for (int64_t r = 0; r < rows; ++r) {
    float top = NEG_INF;
    for (int64_t s = 0; s < p.splits; ++s) top = std::max(top, m[s * ROWS + r]);
    float total = 0.0f;
    for (int64_t s = 0; s < p.splits; ++s) {
      w[s] = m[s * ROWS + r] == NEG_INF ? 0.0f : std::exp(m[s * ROWS + r] - top);
      total += w[s] * l[s * ROWS + r];
    }
    float* o = p.out + ((q0 + r / p.G) * p.H + h * p.G + r % p.G) * p.D;
    for (int64_t d = 0; d < p.D; ++d) {
      float x = 0.0f;
      for (int64_t s = 0; s < p.splits; ++s) x += w[s] * acc[s * stride + d * ROWS + r];
      o[d] = x / total;
    }
  }
}

}  // namespace

// out [Q, H, D] = causal attention of query [Q, H, D] (the last Q of seq_len positions) over the
// cached keys/values [blocks, BS, Hkv, D] of `table` (the sequence's block ids, int64).
void paged_prefill(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                   torch::Tensor table, int64_t seq_len, double scale, torch::Tensor out) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32 &&
                  value_cache.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "paged_prefill takes float32 queries and caches");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && table.scalar_type() == torch::kInt64,
              "query [Q, H, D], caches [blocks, block_size, H_kv, D], table int64");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  out.is_contiguous() && out.sizes() == query.sizes(), "contiguous tensors");
  table = table.contiguous();
  Problem p{};
  p.Q = query.size(0), p.H = query.size(1), p.D = query.size(2);
  p.BS = key_cache.size(1), p.Hkv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == p.D && p.H % p.Hkv == 0 && p.D % DB == 0, "head shapes");
  p.G = p.H / p.Hkv;
  TORCH_CHECK(p.G <= ROWS && p.BS <= MAX_BLOCK && p.Q <= seq_len && seq_len > 0, "sizes out of range");
  TORCH_CHECK(table.numel() * p.BS >= seq_len, "the block table does not cover seq_len");
  p.q = query.data_ptr<float>(), p.k = key_cache.data_ptr<float>(), p.v = value_cache.data_ptr<float>();
  p.table = table.data_ptr<int64_t>(), p.out = out.data_ptr<float>();
  p.seq_len = seq_len, p.scale = static_cast<float>(scale);
  p.QT = ROWS / p.G;
  p.tiles = (p.Q + p.QT - 1) / p.QT;
  const int64_t items = p.Hkv * p.tiles, want = 4 * at::get_num_threads();
  p.splits = items >= want ? 1 : std::min((want + items - 1) / items, (seq_len + 255) / 256);
  p.split_len = ((seq_len + p.splits - 1) / p.splits + p.BS - 1) / p.BS * p.BS;
  const int64_t rv = (std::min(p.QT, p.Q) * p.G + VW - 1) / VW;  // row vectors a full tile needs
  const int64_t stride = p.D * ROWS;
  // One split: each item normalizes its own rows; several: partials, then a merge.
  const bool direct = p.splits == 1;
  std::vector<float> acc(direct ? 0 : items * p.splits * stride);
  std::vector<float> ms(direct ? 0 : items * p.splits * ROWS), ls(ms.size());
  at::parallel_for(0, items * p.splits, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qt(p.D * ROWS), own(direct ? stride : 0);
    alignas(64) float m[ROWS], l[ROWS];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t split = i % p.splits, tile = (i / p.splits) % p.tiles, h = i / p.splits / p.tiles;
      float* a = direct ? own.data() : acc.data() + i * stride;
      float* mo = direct ? m : ms.data() + i * ROWS;
      float* lo = direct ? l : ls.data() + i * ROWS;
      switch (rv) {
        case 1: item<1>(p, h, tile, split, qt.data(), a, mo, lo); break;
        case 2: item<2>(p, h, tile, split, qt.data(), a, mo, lo); break;
        default: item<3>(p, h, tile, split, qt.data(), a, mo, lo); break;
      }
      if (direct) merge(p, h, tile, a, mo, lo, stride);
    }
  });
  if (direct) return;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      merge(p, i / p.tiles, i % p.tiles, acc.data() + i * p.splits * stride,
            ms.data() + i * p.splits * ROWS, ls.data() + i * p.splits * ROWS, stride);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill", &paged_prefill, "causal prefill attention over the paged KV cache, in place");
}
