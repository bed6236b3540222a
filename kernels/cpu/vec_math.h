// Lane-wise helpers over tile_gemm.h's float vectors: stores, broadcasts and e^x, shared by the
// attention kernels (paged_attention.cpp, decoder_step.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#include "tile_gemm.h"

namespace dgpp_tile {

typedef int32_t ivec __attribute__((vector_size(VW * sizeof(int32_t))));

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

}  // namespace dgpp_tile
