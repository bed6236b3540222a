// The decode step of a Llama-family decoder on CPU in one native call: every layer's RMSNorm, the
// fused q/k/v product (with biases; Qwen3's per-head q/k RMSNorm), rotary, the KV-cache store,
// decode attention over the paged cache (decode_attention.h, read in place), the o product with
// the residual add, RMSNorm, gate/up with SiLU-and-mul, and down with the residual add, for a
// batch of decode rows (one query token each). No Python, no PyTorch dispatch and no tensor
// allocation between two products: each product is one parallel region over its output rows
// with its epilogue (bias, residual add, SiLU-and-mul) in the same region; the small per-row
// work between them (norms, rotary, the cache store) runs on the calling thread.
//
// Weights are GGML blocks (Q4_0, Q4_1, Q8_0: decoded in registers, ggml_gemv.h) or dense rows of
// float32, bfloat16 or float16 (dense_gemv.h); products accumulate in float32. From the tile
// GEMM's row count on (batched decode), products decode a few weight rows at a time into an L1
// tile (tile_gemm.h). The arithmetic is the PyTorch layer path's (dequantize, float32 products)
// up to summation order; the twin is that path itself (engine/models/llama.py), which serves
// every step this does not take (prefill chunks, verify rows, other families). Each phase's
// time is summed (`phase_seconds`: a profile of the step without a profiler).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_attention.h"
#include "dense_gemv.h"
#include "ggml_gemv.h"
#include "rms_norm_row.h"
#include "tile_gemm.h"

namespace {

using dgpp_dense::BF16;
using dgpp_dense::F16;
using dgpp_dense::F32;
using dgpp_dense::Q4_0;
using dgpp_dense::Q4_1;
using dgpp_dense::Q8_0;
using dgpp_tile::VW;

// The step's phases, as `phase_seconds` reports them.
enum Phase { PHASE_QKV, PHASE_ROTARY_STORE, PHASE_ATTENTION, PHASE_O, PHASE_GATE_UP, PHASE_DOWN, PHASES };

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Linear {
  torch::Tensor weight, bias;  // bias: empty when the layer has none
  int64_t kind = F32, N = 0, K = 0, row_bytes = 0;

  Linear() = default;
  Linear(torch::Tensor w, int64_t kind_, int64_t K_, torch::Tensor b)
      : weight(w.contiguous()), bias(b.contiguous()), kind(kind_), N(w.size(0)), K(K_) {
    row_bytes = weight.size(1) * weight.element_size();
    const bool ggml = kind == Q4_0 || kind == Q4_1 || kind == Q8_0;
    if (ggml) {
      TORCH_CHECK(weight.scalar_type() == torch::kUInt8 && K % dgpp_ggml::QK == 0 &&
                      row_bytes == K / dgpp_ggml::QK * dgpp_ggml::type_size(kind),
                  "GGML weight rows do not hold ", K, " weights");
    } else {
      const auto want = kind == F32 ? torch::kFloat32 : kind == BF16 ? torch::kBFloat16 : torch::kFloat16;
      TORCH_CHECK(kind == F32 || kind == BF16 || kind == F16, "unsupported weight kind ", kind);
      TORCH_CHECK(weight.scalar_type() == want && weight.size(1) == K, "dense weight [N, K] of its kind");
    }
    TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == torch::kFloat32 && bias.numel() == N),
                "bias: float32 [N] or none");
  }

  bool ggml() const { return kind == Q4_0 || kind == Q4_1 || kind == Q8_0; }

  // Rows n0 .. n1 of y [M, ldy] = x [M, K] W^T (no bias); xsum: x's block sums (GGML, AVX2).
  void rows(const float* x, int64_t M, const float* xsum, int64_t n0, int64_t n1, float* y,
            int64_t ldy) const {
    const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
    if (ggml()) {
      TORCH_CHECK(ldy == N, "GGML rows write y with stride N");
#ifdef DGPP_AVX2
      dgpp_ggml::gemv_rows_avx2(x, M, K, w, row_bytes, kind, dgpp_ggml::type_size(kind), n0, n1, y, N, xsum);
#else
      (void)xsum;
      dgpp_ggml::gemv_rows(x, M, K, w, row_bytes, kind, dgpp_ggml::type_size(kind), n0, n1, y, N);
#endif
      return;
    }
    switch (kind) {
      case F32: dgpp_dense::dense_rows<F32>(x, M, K, w, row_bytes, n0, n1, y, ldy); break;
      case BF16: dgpp_dense::dense_rows<BF16>(x, M, K, w, row_bytes, n0, n1, y, ldy); break;
      default: dgpp_dense::dense_rows<F16>(x, M, K, w, row_bytes, n0, n1, y, ldy); break;
    }
  }

  // Weight rows n0 .. n0 + rows as float32 [rows, K] (the tile GEMM's decode).
  void decode(int64_t n0, int64_t rows, float* out) const {
    const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = w + (n0 + r) * row_bytes;
      float* o = out + r * K;
      if (ggml()) {
        const int64_t ts = dgpp_ggml::type_size(kind);
        for (int64_t b = 0; b < K / dgpp_ggml::QK; ++b)
#ifdef DGPP_AVX2
          dgpp_ggml::dequant_block_avx2(kind, row + b * ts, o + b * dgpp_ggml::QK);
#else
          dgpp_ggml::dequant_block(kind, row + b * ts, o + b * dgpp_ggml::QK);
#endif
      } else if (kind == F32) {
        std::memcpy(o, row, K * sizeof(float));
      } else {
        for (int64_t k = 0; k < K; ++k) o[k] = kind == BF16 ? dgpp_dense::weight_at<BF16>(row, k) : dgpp_dense::weight_at<F16>(row, k);
      }
    }
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm, q_norm, k_norm;  // q/k norms: empty unless Qwen3
  Linear qkv, o, gate_up, down;
  torch::Tensor key_cache, value_cache;  // [blocks, block_size, H_kv, D], or quantized rows
  int64_t kind = dgpp_decode::KV_F32;  // int8: D / 32 Q8_0 blocks a head; fp8: a scale, D codes
};

using dgpp_norm::rms_norm_row;

// x * cos + roll(x, D / 2) * signed sin, in place (the rotate-half layout).
void rotate(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = x[d], b = x[d + half];
    x[d] = a * cos[d] + b * sin[d];
    x[d + half] = b * cos[d + half] + a * sin[d + half];
  }
}

}  // namespace

class DecoderStep {
 public:
  DecoderStep(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
              double eps, double scale, int64_t tile_rows)
      : H_(hidden), heads_(heads), kv_heads_(kv_heads), D_(head_dim), I_(intermediate),
        eps_(static_cast<float>(eps)), scale_(scale), tile_rows_(tile_rows) {
    TORCH_CHECK(head_dim <= 512 && head_dim % 2 == 0, "head_dim up to 512, even");
  }

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, torch::Tensor q_norm,
                 torch::Tensor k_norm, torch::Tensor qkv, int64_t qkv_kind, torch::Tensor qkv_bias,
                 torch::Tensor o, int64_t o_kind, torch::Tensor gate_up, int64_t gate_up_kind,
                 torch::Tensor down, int64_t down_kind, torch::Tensor cache, int64_t kv_kind) {
    Layer l;
    l.input_norm = input_norm.contiguous();
    l.post_norm = post_norm.contiguous();
    l.q_norm = q_norm.contiguous();
    l.k_norm = k_norm.contiguous();
    const torch::Tensor none;
    l.qkv = Linear(qkv, qkv_kind, H_, qkv_bias.defined() ? qkv_bias : torch::empty({0}));
    l.o = Linear(o, o_kind, heads_ * D_, torch::empty({0}));
    l.gate_up = Linear(gate_up, gate_up_kind, H_, torch::empty({0}));
    l.down = Linear(down, down_kind, I_, torch::empty({0}));
    TORCH_CHECK(l.qkv.N == (heads_ + 2 * kv_heads_) * D_ && l.o.N == H_ && l.gate_up.N == 2 * I_ &&
                    l.down.N == H_, "layer shapes");
    if (kv_kind != dgpp_decode::KV_F32) {
      TORCH_CHECK((kv_kind == dgpp_decode::KV_FP8 || D_ % dgpp_decode::Q8_BLOCK == 0) &&
                      cache.dim() == 5 && cache.size(0) == 2 && cache.size(3) == kv_heads_ &&
                      cache.size(4) == dgpp_decode::kv_row_bytes(kv_kind, D_) &&
                      cache.scalar_type() == torch::kUInt8 && cache.is_contiguous(),
                  "quantized cache [2, blocks, block_size, H_kv, row bytes] uint8");
    } else {
      TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.size(3) == kv_heads_ &&
                      cache.size(4) == D_ && cache.scalar_type() == torch::kFloat32 && cache.is_contiguous(),
                  "cache [2, blocks, block_size, H_kv, D] float32");
    }
    l.kind = kv_kind;
    l.key_cache = cache.select(0, 0);
    l.value_cache = cache.select(0, 1);
    layers_.push_back(std::move(l));
  }

  // hidden [B, H] (the residual stream after the embedding) through every layer, in place;
  // cos/sin [B, D] (signed sin), slots [B], block_tables [B, W], seq_lens [B] (int64).
  void forward(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
               torch::Tensor block_tables, torch::Tensor seq_lens) {
    TORCH_CHECK(hidden.scalar_type() == torch::kFloat32 && hidden.is_contiguous() && hidden.dim() == 2 &&
                    hidden.size(1) == H_, "hidden [B, hidden] float32 contiguous");
    const int64_t B = hidden.size(0);
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * D_ && sin.numel() == B * D_,
                "cos/sin [B, D]");
    TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == B && seq_lens.numel() == B,
                "a slot and a length per row");
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t QKV = (heads_ + 2 * kv_heads_) * D_;
    auto f32 = hidden.options();
    auto xn = torch::empty({B, H_}, f32), qkv = torch::empty({B, QKV}, f32);
    auto q = torch::empty({B, heads_, D_}, f32), attn = torch::empty({B, heads_, D_}, f32);
    auto y = torch::empty({B, std::max(2 * I_, QKV)}, f32), act = torch::empty({B, I_}, f32);
    std::vector<float> xsum(B * std::max(H_, std::max(I_, heads_ * D_)) / dgpp_ggml::QK + 1);
    float* x = hidden.data_ptr<float>();
    float* xnp = xn.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t block_size = layers_.empty() ? 1 : layers_[0].key_cache.size(1);
    TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous() &&
                    block_tables.dim() == 2 && block_tables.size(0) == B && seq_lens.is_contiguous() &&
                    seq_lens.scalar_type() == torch::kInt64, "int64 tables [B, W] and lengths [B]");
    const int64_t* table = block_tables.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t width = block_tables.size(1);
    const int64_t blocks = layers_.empty() ? 0 : layers_[0].key_cache.size(0);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(lens[b] >= 1 && (lens[b] + block_size - 1) / block_size <= width, "row ", b, ": ",
                  lens[b], " positions, ", width, " blocks");
      TORCH_CHECK(slot[b] >= 0 && slot[b] < blocks * block_size, "row ", b, ": slot ", slot[b],
                  " outside the cache");
      for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i)
        TORCH_CHECK(table[b * width + i] >= 0 && table[b * width + i] < blocks, "row ", b,
                    ": block ", table[b * width + i], " outside the cache");
    }
    for (const Layer& l : layers_) {
      double t0 = now();
      for (int64_t b = 0; b < B; ++b)
        rms_norm_row(x + b * H_, l.input_norm.data_ptr<float>(), xnp + b * H_, H_, eps_);
      product(l.qkv, xnp, B, xsum.data(), qkvp, [&](int64_t n0, int64_t n1) {
        if (l.qkv.bias.numel() == 0) return;
        const float* bias = l.qkv.bias.data_ptr<float>();
        for (int64_t b = 0; b < B; ++b)
          for (int64_t n = n0; n < n1; ++n) qkvp[b * QKV + n] += bias[n];
      });
      double t1 = now();
      seconds_[PHASE_QKV] += t1 - t0;
      const bool quantized = l.kind != dgpp_decode::KV_F32;
      float* kc = quantized ? nullptr : l.key_cache.data_ptr<float>();
      float* vc = quantized ? nullptr : l.value_cache.data_ptr<float>();
      uint8_t* kq = quantized ? l.key_cache.data_ptr<uint8_t>() : nullptr;
      uint8_t* vq = quantized ? l.value_cache.data_ptr<uint8_t>() : nullptr;
      const int64_t q_row = dgpp_decode::kv_row_bytes(l.kind, D_);
      for (int64_t b = 0; b < B; ++b) {
        float* row = qkvp + b * QKV;
        const float* c = cp + b * D_;
        const float* s = sp + b * D_;
        for (int64_t h = 0; h < heads_ + kv_heads_; ++h) {
          float* head = row + h * D_;
          if (l.q_norm.numel() != 0)
            rms_norm_row(head, (h < heads_ ? l.q_norm : l.k_norm).data_ptr<float>(), head, D_, eps_);
          rotate(head, c, s, D_);
        }
        std::memcpy(qp + b * heads_ * D_, row, heads_ * D_ * sizeof(float));
        if (quantized) {  // each head's key and value as its quantized row
          for (int64_t g = 0; g < kv_heads_; ++g) {
            const int64_t at = (slot[b] * kv_heads_ + g) * q_row;
            dgpp_decode::store_row(l.kind, row + (heads_ + g) * D_, D_, kq + at);
            dgpp_decode::store_row(l.kind, row + (heads_ + kv_heads_ + g) * D_, D_, vq + at);
          }
          continue;
        }
        const int64_t at = slot[b] * kv_heads_ * D_;  // slots index the [blocks * block_size] rows
        std::memcpy(kc + at, row + heads_ * D_, kv_heads_ * D_ * sizeof(float));
        std::memcpy(vc + at, row + (heads_ + kv_heads_) * D_, kv_heads_ * D_ * sizeof(float));
      }
      double t2 = now();
      seconds_[PHASE_ROTARY_STORE] += t2 - t1;
      dgpp_decode::decode_attention({qp, kc, vc, table, lens, width, block_size, heads_, kv_heads_, D_,
                        static_cast<float>(scale_), kq, vq, l.kind}, B, attn.data_ptr<float>());
      double t3 = now();
      seconds_[PHASE_ATTENTION] += t3 - t2;
      product(l.o, attn.data_ptr<float>(), B, xsum.data(), yp, [&](int64_t n0, int64_t n1) {
        for (int64_t b = 0; b < B; ++b)
          for (int64_t n = n0; n < n1; ++n) x[b * H_ + n] += yp[b * H_ + n];
      });
      double t4 = now();
      seconds_[PHASE_O] += t4 - t3;
      for (int64_t b = 0; b < B; ++b)
        rms_norm_row(x + b * H_, l.post_norm.data_ptr<float>(), xnp + b * H_, H_, eps_);
      gate_up(l.gate_up, xnp, B, xsum.data(), yp, actp);
      double t5 = now();
      seconds_[PHASE_GATE_UP] += t5 - t4;
      product(l.down, actp, B, xsum.data(), yp, [&](int64_t n0, int64_t n1) {
        for (int64_t b = 0; b < B; ++b)
          for (int64_t n = n0; n < n1; ++n) x[b * H_ + n] += yp[b * H_ + n];
      });
      seconds_[PHASE_DOWN] += now() - t5;
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Seconds in each phase (q/k/v product, rotary and cache store, attention, o product, gate/up,
  // down) summed over every layer of the steps since the last call; then zeroed.
  std::vector<double> phase_seconds() {
    std::vector<double> out(seconds_.begin(), seconds_.end());
    seconds_.fill(0.0);
    return out;
  }

 private:
  // y [B, L.N] = x L^T, then `epilogue(n0, n1)` over each thread's output rows (in the same
  // parallel region below the tile GEMM's row count; after the GEMM from there on).
  template <typename Epilogue>
  void product(const Linear& L, const float* x, int64_t B, float* xsum, float* y,
               const Epilogue& epilogue) const {
    if (B >= tile_rows_ && L.K % VW == 0) {
      dgpp_tile::gemm(x, B, L.K, L.N, y, [&](int64_t n0, int64_t rows, float* out) { L.decode(n0, rows, out); });
      at::parallel_for(0, L.N, 64, [&](int64_t n0, int64_t n1) { epilogue(n0, n1); });
      return;
    }
#ifdef DGPP_AVX2
    if (dgpp_ggml::USES_BLOCK_SUMS && L.ggml()) dgpp_ggml::block_sums(x, B, L.K, xsum);
#endif
    at::parallel_for(0, L.N, 16, [&](int64_t n0, int64_t n1) {
      L.rows(x, B, xsum, n0, n1, y, L.N);
      epilogue(n0, n1);
    });
  }

  // act [B, I] = silu(gate) * up, gate and up the two halves of x L^T: each thread takes output
  // rows n of gate and the same rows I + n of up.
  void gate_up(const Linear& L, const float* x, int64_t B, float* xsum, float* y, float* act) const {
    const int64_t I = I_;
    auto finish = [&](int64_t n0, int64_t n1) {
      for (int64_t b = 0; b < B; ++b)
        for (int64_t n = n0; n < n1; ++n) {
          const float g = y[b * 2 * I + n];
          act[b * I + n] = g / (1.0f + std::exp(-g)) * y[b * 2 * I + I + n];
        }
    };
    if (B >= tile_rows_ && L.K % VW == 0) {
      dgpp_tile::gemm(x, B, L.K, L.N, y, [&](int64_t n0, int64_t rows, float* out) { L.decode(n0, rows, out); });
      at::parallel_for(0, I, 64, finish);
      return;
    }
#ifdef DGPP_AVX2
    if (dgpp_ggml::USES_BLOCK_SUMS && L.ggml()) dgpp_ggml::block_sums(x, B, L.K, xsum);
#endif
    at::parallel_for(0, I, 16, [&](int64_t n0, int64_t n1) {
      L.rows(x, B, xsum, n0, n1, y, L.N);
      L.rows(x, B, xsum, I + n0, I + n1, y, L.N);
      finish(n0, n1);
    });
  }

  int64_t H_, heads_, kv_heads_, D_, I_;
  float eps_;
  double scale_;
  int64_t tile_rows_;
  std::vector<Layer> layers_;
  std::array<double, PHASES> seconds_{};
};

// module_local: another build of this source in the same process (the portable build the tests
// load beside it, or a checkout's rebuilt kernel) registers its own DecoderStep, not a clash.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecoderStep>(m, "DecoderStep", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t>())
      .def("add_layer", &DecoderStep::add_layer)
      .def("forward", &DecoderStep::forward)
      .def("num_layers", &DecoderStep::num_layers)
      .def("phase_seconds", &DecoderStep::phase_seconds);
  m.def("tile_rows", [] { return dgpp_tile::FROM_ROWS; }, "rows of x from which the tile GEMM pays");
}
