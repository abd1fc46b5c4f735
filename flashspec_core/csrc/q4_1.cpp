// Q4_1 weights x int8 activation blocks on the CPU: the products of a GGUF file's 4-bit matrices at their own
// precision, with each token's row computed on its own (a verify of K + 1 tokens gives the bits of K + 1 steps).
//
// Each activation row is quantised per block of 32 (int8, scale d = max|x| / 127, as llama.cpp's Q8_1), so a
// block's product is an exact integer sum: out[t, n] = sum over blocks b of
//   (sum_k q[n, k] * xq[t, k]) * (dw[n, b] * dx[t, b]) + mw[n, b] * (dx[t, b] * sum_k xq[t, k]),
// accumulated block after block with fused multiply-adds in float32. The AVX512-VNNI kernel and the portable
// loop run the same float operations in the same order, so both give the same bits.
//
// Weights are repacked for 16 output rows at a time (one 512-bit lane per row): for rows 16g..16g+15 and block b,
// 256 bytes = 4 chunks of 64, chunk c holding for each row r the 4 weights of quad c (low nibbles) and of quad
// c + 4 (high nibbles) at bytes 4r..4r+3; dm [N/16, K/32, 2, 16] float16 holds d and m of those rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define FLASHSPEC_VNNI 1
#else
#define FLASHSPEC_VNNI 0
#endif

namespace {

constexpr int64_t QK = 32;    // weights per block
constexpr int64_t ROWS = 16;  // output rows per packed group
constexpr int64_t TILE = 4;   // tokens whose accumulators stay in registers

struct Activations {  // one forward's rows, quantised per block
  std::vector<int8_t> q;  // [T, K]
  std::vector<float> d;   // [T, K / 32]
  std::vector<float> s;   // [T, K / 32]: d * sum of the block's q
  std::vector<int32_t> sum;  // [T, K / 32]: sum of the block's q
};

// One block of 32: q = round-half-even(v / d) with d = max|v| / 127 (q = 0 where d = 0); returns sum of q.
int32_t quantize_block_portable(const float* v, int8_t* q, float& d) {
  float amax = 0.f;
  for (int64_t k = 0; k < QK; ++k) amax = std::max(amax, std::fabs(v[k]));
  d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int64_t k = 0; k < QK; ++k) {
    q[k] = static_cast<int8_t>(std::nearbyint(v[k] * id));
    sum += q[k];
  }
  return sum;
}

#if FLASHSPEC_VNNI
int32_t quantize_block_vnni(const float* v, int8_t* q, float& d) {  // the same numbers as the portable loop
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  d = amax / 127.f;
  const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}
#endif

Activations quantize(const at::Tensor& x, bool portable) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t T = xf.size(0), K = xf.size(1), B = K / QK;
  Activations a{std::vector<int8_t>(T * K), std::vector<float>(T * B), std::vector<float>(T * B),
                std::vector<int32_t>(T * B)};
  const float* src = xf.data_ptr<float>();
  for (int64_t i = 0; i < T * B; ++i) {  // block i = row i / B, block i % B: rows are contiguous
    float d;
#if FLASHSPEC_VNNI
    const int32_t sum = portable ? quantize_block_portable(src + i * QK, a.q.data() + i * QK, d)
                                 : quantize_block_vnni(src + i * QK, a.q.data() + i * QK, d);
#else
    const int32_t sum = quantize_block_portable(src + i * QK, a.q.data() + i * QK, d);
#endif
    a.d[i] = d;
    a.s[i] = d * static_cast<float>(sum);
    a.sum[i] = sum;
  }
  return a;
}

// Rows 16g..16g+15 for tokens t0..t0+nt-1 (nt <= TILE), portable: the reference the vector kernel matches.
void group_portable(const uint8_t* w, const at::Half* dm, const Activations& a, int64_t K, int64_t t0, int64_t nt,
                    float* out, int64_t N, int64_t g) {
  const int64_t B = K / QK;
  float acc[TILE][ROWS] = {};
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* wb = w + b * 256;
    const at::Half* dmb = dm + b * 2 * ROWS;
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t t = t0 + i;
      const int8_t* xq = a.q.data() + t * K + b * QK;
      const float dx = a.d[t * B + b], sx = a.s[t * B + b];
      for (int64_t r = 0; r < ROWS; ++r) {
        int32_t isum = 0;
        for (int64_t c = 0; c < 4; ++c) {
          for (int64_t j = 0; j < 4; ++j) {
            const uint8_t byte = wb[c * 64 + r * 4 + j];
            isum += static_cast<int32_t>(byte & 0x0F) * xq[c * 4 + j];
            isum += static_cast<int32_t>(byte >> 4) * xq[(c + 4) * 4 + j];
          }
        }
        const float scale = static_cast<float>(dmb[r]) * dx;
        acc[i][r] = std::fma(static_cast<float>(isum), scale, acc[i][r]);
        acc[i][r] = std::fma(static_cast<float>(dmb[ROWS + r]), sx, acc[i][r]);
      }
    }
  }
  for (int64_t i = 0; i < nt; ++i) std::memcpy(out + (t0 + i) * N + g * ROWS, acc[i], sizeof(acc[i]));
}

#if FLASHSPEC_VNNI
template <int64_t nt>  // tokens t0..t0+nt-1: a constant, so the accumulators live in registers
void group_vnni(const uint8_t* w, const at::Half* dm, const Activations& a, int64_t K, int64_t t0,
                float* out, int64_t N, int64_t g) {
  const int64_t B = K / QK;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[nt];
  for (int64_t i = 0; i < nt; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* wb = w + b * 256;
    __m512i q[8];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wb + c * 64);
      q[c] = _mm512_and_si512(v, low);
      q[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + b * 2 * ROWS)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + b * 2 * ROWS + ROWS)));
    __m512i s0[nt], s1[nt];  // two independent chains per token (an exact integer sum in any order)
    for (int64_t i = 0; i < nt; ++i) s0[i] = s1[i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
      for (int64_t i = 0; i < nt; ++i) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(a.q.data() + (t0 + i) * K + b * QK);
        s0[i] = _mm512_dpbusd_epi32(s0[i], q[j], _mm512_set1_epi32(xq[j]));
        s1[i] = _mm512_dpbusd_epi32(s1[i], q[j + 1], _mm512_set1_epi32(xq[j + 1]));
      }
    }
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t t = t0 + i;
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[t * B + b]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0[i], s1[i])), scale, acc[i]);
      acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[t * B + b]), acc[i]);
    }
  }
  for (int64_t i = 0; i < nt; ++i) _mm512_storeu_ps(out + (t0 + i) * N + g * ROWS, acc[i]);
}
#endif

// Q8_0 (weight = d * q, q int8, d float16 per block of 32), stored as q + 128 (uint8, for the unsigned operand of
// the int8 dot product): rows 16g..16g+15, block b: 8 chunks of 64 bytes, chunk j holding row r's weights
// 4j..4j+3 at bytes 4r..4r+3. A block's exact sum is sum (q + 128) * xq - 128 * sum xq; then
// acc = fma(float(sum), dw * dx, acc), block after block.
void q8_group_portable(const uint8_t* w, const at::Half* dw, const Activations& a, int64_t K, int64_t t0, int64_t nt,
                       float* out, int64_t N, int64_t g) {
  const int64_t B = K / QK;
  float acc[TILE][ROWS] = {};
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* wb = w + b * 512;
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t t = t0 + i;
      const int8_t* xq = a.q.data() + t * K + b * QK;
      for (int64_t r = 0; r < ROWS; ++r) {
        int32_t isum = 0;
        for (int64_t j = 0; j < 8; ++j)
          for (int64_t k = 0; k < 4; ++k) isum += static_cast<int32_t>(wb[j * 64 + r * 4 + k]) * xq[j * 4 + k];
        isum -= 128 * a.sum[t * B + b];
        acc[i][r] = std::fma(static_cast<float>(isum), static_cast<float>(dw[b * ROWS + r]) * a.d[t * B + b], acc[i][r]);
      }
    }
  }
  for (int64_t i = 0; i < nt; ++i) std::memcpy(out + (t0 + i) * N + g * ROWS, acc[i], sizeof(acc[i]));
}

#if FLASHSPEC_VNNI
template <int64_t nt>
void q8_group_vnni(const uint8_t* w, const at::Half* dw, const Activations& a, int64_t K, int64_t t0, float* out,
                   int64_t N, int64_t g) {
  const int64_t B = K / QK;
  __m512 acc[nt];
  for (int64_t i = 0; i < nt; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* wb = w + b * 512;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dw + b * ROWS)));
    __m512i s0[nt], s1[nt];
    for (int64_t i = 0; i < nt; ++i) s0[i] = s1[i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
      const __m512i q0 = _mm512_loadu_si512(wb + j * 64), q1 = _mm512_loadu_si512(wb + (j + 1) * 64);
      for (int64_t i = 0; i < nt; ++i) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(a.q.data() + (t0 + i) * K + b * QK);
        s0[i] = _mm512_dpbusd_epi32(s0[i], q0, _mm512_set1_epi32(xq[j]));
        s1[i] = _mm512_dpbusd_epi32(s1[i], q1, _mm512_set1_epi32(xq[j + 1]));
      }
    }
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t t = t0 + i;
      const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(s0[i], s1[i]), _mm512_set1_epi32(128 * a.sum[t * B + b]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(a.d[t * B + b])), acc[i]);
    }
  }
  for (int64_t i = 0; i < nt; ++i) _mm512_storeu_ps(out + (t0 + i) * N + g * ROWS, acc[i]);
}
#endif

at::Tensor q8_0_linear_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, bool portable) {
  TORCH_CHECK(x.dim() == 2, "x must be [T, K], got ", x.sizes());
  TORCH_CHECK(packed.dtype() == at::kByte && packed.dim() == 3 && packed.size(2) == 512 && packed.is_contiguous(),
              "packed must be contiguous uint8 [N/16, K/32, 512]");
  TORCH_CHECK(d.dtype() == at::kHalf && d.is_contiguous(), "d must be contiguous float16 [N/16, K/32, 16]");
  const int64_t T = x.size(0), K = x.size(1), G = packed.size(0), N = G * ROWS, B = K / QK;
  TORCH_CHECK(K == packed.size(1) * QK, "x has K = ", K, " but the weights ", packed.size(1) * QK);
  const Activations a = quantize(x, portable);
  at::Tensor out = at::empty({T, N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* dw = d.data_ptr<at::Half>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        const int64_t nt = std::min(TILE, T - t0);
        const uint8_t* wg = w + g * B * 512;
        const at::Half* dg = dw + g * B * ROWS;
#if FLASHSPEC_VNNI
        if (!portable) {
          switch (nt) {
            case 1: q8_group_vnni<1>(wg, dg, a, K, t0, o, N, g); break;
            case 2: q8_group_vnni<2>(wg, dg, a, K, t0, o, N, g); break;
            case 3: q8_group_vnni<3>(wg, dg, a, K, t0, o, N, g); break;
            default: q8_group_vnni<4>(wg, dg, a, K, t0, o, N, g); break;
          }
          continue;
        }
#endif
        q8_group_portable(wg, dg, a, K, t0, nt, o, N, g);
      }
    }
  });
  return out;
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d) {
  return q8_0_linear_impl(x, packed, d, false);
}

at::Tensor q8_0_linear_portable(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d) {
  return q8_0_linear_impl(x, packed, d, true);
}

at::Tensor q4_1_linear_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm, bool portable) {
  TORCH_CHECK(x.dim() == 2, "x must be [T, K], got ", x.sizes());
  TORCH_CHECK(packed.dtype() == at::kByte && packed.dim() == 3 && packed.size(2) == 256 && packed.is_contiguous(),
              "packed must be contiguous uint8 [N/16, K/32, 256]");
  TORCH_CHECK(dm.dtype() == at::kHalf && dm.is_contiguous(), "dm must be contiguous float16 [N/16, K/32, 2, 16]");
  const int64_t T = x.size(0), K = x.size(1), G = packed.size(0), N = G * ROWS;
  TORCH_CHECK(K == packed.size(1) * QK, "x has K = ", K, " but the weights ", packed.size(1) * QK);
  const Activations a = quantize(x, portable);
  at::Tensor out = at::empty({T, N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* s = dm.data_ptr<at::Half>();
  const int64_t B = K / QK;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        const int64_t nt = std::min(TILE, T - t0);
#if FLASHSPEC_VNNI
        if (!portable) {
          const uint8_t* wg = w + g * B * 256;
          const at::Half* dmg = s + g * B * 2 * ROWS;
          switch (nt) {
            case 1: group_vnni<1>(wg, dmg, a, K, t0, o, N, g); break;
            case 2: group_vnni<2>(wg, dmg, a, K, t0, o, N, g); break;
            case 3: group_vnni<3>(wg, dmg, a, K, t0, o, N, g); break;
            default: group_vnni<4>(wg, dmg, a, K, t0, o, N, g); break;
          }
          continue;
        }
#endif
        group_portable(w + g * B * 256, s + g * B * 2 * ROWS, a, K, t0, nt, o, N, g);
      }
    }
  });
  return out;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm) {
  return q4_1_linear_impl(x, packed, dm, false);
}

at::Tensor q4_1_linear_portable(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm) {
  return q4_1_linear_impl(x, packed, dm, true);
}

bool vnni() { return FLASHSPEC_VNNI; }

// StaticCausalLM's layers on the GGUF path (fast_path.gguf_layers with these products): x [B*T, hidden] float32,
// updated in place, with cos, sin [T, 1, D] (bfloat16) at the tokens' rotary positions; K/V written to the cache
// slots pos [T] of kv_cache[i] [2, B, KV, capacity, D]; attention over slots [0, S) through the additive mask
// [R*T, S]. weights: 10 per layer (input norm, q/k/v packed and dm, o packed and dm, post norm, gate/up packed and
// dm, down packed and dm). Returns the residual streams entering the aux layers, in their order.
std::vector<at::Tensor> gguf_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pos,
                                    const at::Tensor& mask, int64_t S, at::IntArrayRef shape, double eps,
                                    double scaling, at::TensorList weights, at::TensorList kv_cache,
                                    at::IntArrayRef aux_layers) {
  const int64_t B = shape[0], T = shape[1], H = shape[2], KV = shape[3], D = shape[4], R = H / KV;
  const int64_t layers = static_cast<int64_t>(kv_cache.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 10 * layers, "10 weights per layer expected");
  std::vector<at::Tensor> saved(aux_layers.size());
  const std::vector<int64_t> hidden{x.size(-1)};
  for (int64_t i = 0; i < layers; ++i) {
    for (size_t j = 0; j < aux_layers.size(); ++j)
      if (aux_layers[j] == i) saved[j] = x.clone();
    const at::Tensor* w = weights.data() + 10 * i;
    at::Tensor h = at::rms_norm(x, hidden, w[0], eps);
    at::Tensor qkv = q4_1_linear(h, w[1], w[2]).to(at::kBFloat16).view({B, T, H + 2 * KV, D});
    at::Tensor qk = qkv.slice(2, 0, H + KV);  // one rotary pass for q and k, in place (sin carries the sign)
    at::Tensor rot = qk.unflatten(-1, {2, D / 2}).flip({-2}).flatten(-2);
    qk.mul_(cos).add_(rot.mul_(sin));
    const at::Tensor& cache = kv_cache[i];
    const_cast<at::Tensor&>(cache).index_copy_(3, pos, qkv.slice(2, H).view({B, T, 2, KV, D}).permute({2, 0, 3, 1, 4}));
    at::Tensor q = qkv.slice(2, 0, H).view({B, T, KV, R, D}).permute({0, 2, 3, 1, 4}).reshape({B, KV, R * T, D});
    at::Tensor o = at::scaled_dot_product_attention(q, cache[0].slice(2, 0, S), cache[1].slice(2, 0, S), mask, 0.0,
                                                    false, scaling);
    o = o.view({B, KV, R, T, D}).permute({0, 3, 1, 2, 4}).reshape({B * T, H * D});
    x.add_(q4_1_linear(o, w[3], w[4]));
    h = at::rms_norm(x, hidden, w[5], eps);
    at::Tensor gate_up = q4_1_linear(h, w[6], w[7]);
    const int64_t half = gate_up.size(-1) / 2;
    x.add_(q4_1_linear(at::silu(gate_up.slice(1, 0, half)).mul_(gate_up.slice(1, half)), w[8], w[9]));
  }
  return saved;
}

}  // namespace

TORCH_LIBRARY(flashspec, m) {
  m.def("q4_1_linear(Tensor x, Tensor packed, Tensor dm) -> Tensor");
  m.def("q4_1_linear_portable(Tensor x, Tensor packed, Tensor dm) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor packed, Tensor d) -> Tensor");
  m.def("q8_0_linear_portable(Tensor x, Tensor packed, Tensor d) -> Tensor");
  m.def("vnni() -> bool", &vnni);  // whether the AVX512-VNNI kernel was compiled in
  m.def("gguf_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor pos, Tensor mask, int S, int[] shape, float eps, "
        "float scaling, Tensor[] weights, Tensor(b!)[] kv_cache, int[] aux_layers) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(flashspec, CPU, m) {
  m.impl("q4_1_linear", q4_1_linear);
  m.impl("q4_1_linear_portable", q4_1_linear_portable);
  m.impl("gguf_layers", gguf_layers);
  m.impl("q8_0_linear", q8_0_linear);
  m.impl("q8_0_linear_portable", q8_0_linear_portable);
}
