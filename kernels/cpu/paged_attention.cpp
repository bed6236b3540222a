// Causal attention of a step's rows (decode rows, verify rows, prefill chunks) over their
// sequences' paged KV cache, read in place through the block tables (no gather of a context into
// a contiguous copy), in one call and one parallel region per layer.
//
// Work items: (row, KV head, tile of queries, span of keys). A tile is the queries x the KV head's
// group of query heads, up to ROWS rows, transposed so that rows lie along vector lanes: the
// scores of one key for every row are one FMA chain over the head dimension with the key's
// elements broadcast, the running max, the exponentials and the sums of an online softmax are
// elementwise across keys, and P.V broadcasts each value element over the rows' probabilities.
// No horizontal sums, no transposed copies of keys or values. A step with few items (decode
// rows, a short chunk deep in a long context) splits each row's keys across threads and merges the spans by their
// log-sum-exp. The same arithmetic as the PyTorch twin (float32, max-subtracted softmax) up to
// summation order and a polynomial exp (Cephes' expf, relative error about 1e-7).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "decode_attention.h"
#include "tile_gemm.h"
#include "vec_math.h"

namespace {

using dgpp_tile::load;
using dgpp_tile::splat;
using dgpp_tile::store;
using dgpp_tile::vexp;
using dgpp_tile::vec;
using dgpp_tile::VW;

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



struct Shape {
  const float* k;  // [blocks, BS, Hkv, D]
  const float* v;
  int64_t H, D, BS, Hkv, G, QT;
  float scale;
  const uint8_t *kq = nullptr, *vq = nullptr;  // a quantized cache instead: [.., Hkv, row bytes]
  int64_t kind = dgpp_decode::KV_F32;            // what kq and vq hold (int8 or fp8 rows)
};

// One row of the step (a decode row, a verify row's queries, a prefill chunk): its Q queries are
// the last Q of its seq_len positions.
struct Row {
  const float* q;  // [Q, H, D]
  float* out;      // [Q, H, D]
  const int64_t* table;
  int64_t Q, seq_len, tiles, splits, split_len;
};

struct Item {
  int64_t row, h, tile, split, partial;  // partial: index of its partial results, -1: direct
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
void item(const Shape& p, const Row& row, int64_t h, int64_t tile, int64_t split, float* qt,
          float* acc, float* m_out, float* l_out, float* scratch) {
  // A quantized cache's block is decoded into `scratch` ([2][MAX_BLOCK][D]: this head's keys
  // and values of one block) and read from there, `D` apart.
  const int64_t D = p.D, G = p.G, ldk = p.kq != nullptr ? D : p.Hkv * D;
  const int64_t q_row = dgpp_decode::kv_row_bytes(p.kind, D);
  const int64_t q0 = tile * p.QT, nq = std::min(p.QT, row.Q - q0), rows = nq * G;
  const int64_t first_pos = row.seq_len - row.Q + q0;
  alignas(64) float pos[ROWS];
  for (int64_t r = 0; r < RV * VW; ++r) {
    const bool real = r < rows;
    const int64_t i = r / G, head = h * G + r % G;
    pos[r] = static_cast<float>(real ? first_pos + i : first_pos);
    const float* qr = row.q + ((q0 + i) * p.H + head) * D;
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
  const int64_t k0 = split * row.split_len;
  const int64_t k1 = std::min({row.seq_len, k0 + row.split_len, last + 1});
  vec S[MAX_BLOCK][RV_MAX];
  for (int64_t base = k0; base < k1; base += p.BS) {
    const int64_t nt = std::min(p.BS, k1 - base);
    const int64_t block = row.table[base / p.BS];
    const float* kb;
    const float* vb;
    if (p.kq != nullptr) {
      for (int64_t t = 0; t < nt; ++t) {
        const int64_t at = ((block * p.BS + t) * p.Hkv + h) * q_row;
        dgpp_decode::decode_row(p.kind, p.kq + at, D, scratch + t * D);
        dgpp_decode::decode_row(p.kind, p.vq + at, D, scratch + (MAX_BLOCK + t) * D);
      }
      kb = scratch, vb = scratch + MAX_BLOCK * D;
    } else {
      kb = p.k + (block * p.BS * p.Hkv + h) * D;
      vb = p.v + (block * p.BS * p.Hkv + h) * D;
    }
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
void merge(const Shape& p, const Row& row, int64_t h, int64_t tile, const float* acc,
           const float* m, const float* l, int64_t stride) {
  const int64_t q0 = tile * p.QT, rows = std::min(p.QT, row.Q - q0) * p.G;
  std::vector<float> w(row.splits);
  for (int64_t r = 0; r < rows; ++r) {
    float top = NEG_INF;
    for (int64_t s = 0; s < row.splits; ++s) top = std::max(top, m[s * ROWS + r]);
    float total = 0.0f;
    for (int64_t s = 0; s < row.splits; ++s) {
      w[s] = m[s * ROWS + r] == NEG_INF ? 0.0f : std::exp(m[s * ROWS + r] - top);
      total += w[s] * l[s * ROWS + r];
    }
    float* o = row.out + ((q0 + r / p.G) * p.H + h * p.G + r % p.G) * p.D;
    for (int64_t d = 0; d < p.D; ++d) {
      float x = 0.0f;
      for (int64_t s = 0; s < row.splits; ++s) x += w[s] * acc[s * stride + d * ROWS + r];
      o[d] = x / total;
    }
  }
}

}  // namespace

// out [T, H, D] = causal attention of query [T, H, D] over the cached keys/values [blocks, BS,
// Hkv, D]: row b's queries are query_start[b] .. query_start[b + 1], the last ones of its
// seq_lens[b] positions, whose blocks are block_tables[b] (int64).
void paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                     torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor seq_lens,
                     double scale, torch::Tensor out, int64_t kv_kind) {
  const bool q8 = kv_kind != dgpp_decode::KV_F32;  // quantized rows (kernels/kv_quant.py)
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32 &&
                  key_cache.scalar_type() == value_cache.scalar_type() &&
                  key_cache.scalar_type() == (q8 ? torch::kUInt8 : torch::kFloat32),
              "paged_attention takes float32 queries and float32 or int8/fp8 (uint8 rows) caches");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && block_tables.dim() == 2,
              "query [T, H, D], caches [blocks, block_size, H_kv, D], tables [B, W]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && query_start.scalar_type() == torch::kInt64 &&
                  seq_lens.scalar_type() == torch::kInt64, "int64 tables, starts and lengths");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  out.is_contiguous() && out.sizes() == query.sizes(), "contiguous tensors");
  block_tables = block_tables.contiguous();
  query_start = query_start.contiguous();
  seq_lens = seq_lens.contiguous();
  Shape p{};
  p.H = query.size(1), p.D = query.size(2), p.BS = key_cache.size(1), p.Hkv = key_cache.size(2);
  const int64_t width = q8 ? dgpp_decode::kv_row_bytes(kv_kind, p.D) : p.D;
  TORCH_CHECK(key_cache.size(3) == width && p.H % p.Hkv == 0 && p.D % DB == 0 &&
                  (kv_kind != dgpp_decode::KV_Q8 || p.D % dgpp_decode::Q8_BLOCK == 0), "head shapes");
  p.kind = kv_kind;
  p.G = p.H / p.Hkv;
  TORCH_CHECK(p.G <= ROWS && p.BS <= MAX_BLOCK, "sizes out of the kernel's range");
  if (q8) {
    p.kq = key_cache.data_ptr<uint8_t>(), p.vq = value_cache.data_ptr<uint8_t>();
  } else {
    p.k = key_cache.data_ptr<float>(), p.v = value_cache.data_ptr<float>();
  }
  p.scale = static_cast<float>(scale);
  p.QT = ROWS / p.G;
  const int64_t B = seq_lens.size(0), tables_width = block_tables.size(1);
  TORCH_CHECK(query_start.size(0) == B + 1 && block_tables.size(0) == B, "one table and start per row");
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[B] == query.size(0), "query_start spans the queries");
  std::vector<Row> rows(B);
  int64_t base_items = 0;
  for (int64_t b = 0; b < B; ++b) {
    Row& r = rows[b];
    r.Q = starts[b + 1] - starts[b], r.seq_len = lens[b];
    TORCH_CHECK(r.Q >= 0 && r.Q <= r.seq_len && (r.seq_len + p.BS - 1) / p.BS <= tables_width,
                "row ", b, ": ", r.Q, " queries, ", r.seq_len, " positions, ", tables_width, " blocks");
    r.q = query.data_ptr<float>() + starts[b] * p.H * p.D;
    r.out = out.data_ptr<float>() + starts[b] * p.H * p.D;
    r.table = block_tables.data_ptr<int64_t>() + b * tables_width;
    r.tiles = (r.Q + p.QT - 1) / p.QT;
    base_items += p.Hkv * r.tiles;
  }
  // Few items (decode rows, a short chunk deep in a long context): split keys across threads.
  const int64_t want = 4 * at::get_num_threads();
  std::vector<Item> items;
  int64_t partials = 0;
  for (int64_t b = 0; b < B; ++b) {
    Row& r = rows[b];
    const int64_t spans = base_items >= want ? 1 : (want + base_items - 1) / base_items;
    r.splits = std::max<int64_t>(1, std::min(spans, (r.seq_len + 255) / 256));
    r.split_len = ((r.seq_len + r.splits - 1) / r.splits + p.BS - 1) / p.BS * p.BS;
    for (int64_t h = 0; h < p.Hkv; ++h)
      for (int64_t t = 0; t < r.tiles; ++t)
        for (int64_t s = 0; s < r.splits; ++s)
          items.push_back({b, h, t, s, r.splits == 1 ? -1 : partials++});
  }
  const int64_t stride = p.D * ROWS;
  std::vector<float> acc(partials * stride), ms(partials * ROWS), ls(partials * ROWS);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qt(p.D * ROWS), own(stride), scratch(q8 ? 2 * MAX_BLOCK * p.D : 0);
    alignas(64) float m[ROWS], l[ROWS];
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const Row& r = rows[it.row];
      const bool direct = it.partial < 0;
      float* a = direct ? own.data() : acc.data() + it.partial * stride;
      float* mo = direct ? m : ms.data() + it.partial * ROWS;
      float* lo = direct ? l : ls.data() + it.partial * ROWS;
      // row vectors the row's first tile needs (later tiles are no fuller)
      switch ((std::min(p.QT, r.Q) * p.G + VW - 1) / VW) {
        case 1: item<1>(p, r, it.h, it.tile, it.split, qt.data(), a, mo, lo, scratch.data()); break;
        case 2: item<2>(p, r, it.h, it.tile, it.split, qt.data(), a, mo, lo, scratch.data()); break;
        default: item<3>(p, r, it.h, it.tile, it.split, qt.data(), a, mo, lo, scratch.data()); break;
      }
      if (direct) merge(p, r, it.h, it.tile, a, mo, lo, stride);
    }
  });
  if (partials == 0) return;
  // Each split (row, h, tile) once, from its first span's item.
  std::vector<const Item*> firsts;
  for (const Item& it : items)
    if (it.partial >= 0 && it.split == 0) firsts.push_back(&it);
  at::parallel_for(0, static_cast<int64_t>(firsts.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = *firsts[i];
      merge(p, rows[it.row], it.h, it.tile, acc.data() + it.partial * stride,
            ms.data() + it.partial * ROWS, ls.data() + it.partial * ROWS, stride);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal attention of a step's rows over the paged KV cache, read in place");
}
