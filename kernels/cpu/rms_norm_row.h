// One row's RMSNorm in float32: y = w * (x / sqrt(mean(x^2) + eps)), the twin's arithmetic
// (`rms_norm_torch`) up to the order of the sum of squares; y may be x. Shared by the RMSNorm
// kernel (rms_norm.cpp) and the fused decode step (decoder_step.cpp).
#pragma once

#include <cmath>
#include <cstdint>

namespace dgpp_norm {

inline void rms_norm_row(const float* x, const float* w, float* y, int64_t K, float eps) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < K; ++k) s += x[k] * x[k];
  const float inv = 1.0f / std::sqrt(s / static_cast<float>(K) + eps);
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) y[k] = w[k] * (x[k] * inv);
}

}  // namespace dgpp_norm
