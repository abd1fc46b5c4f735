// The GGUF path's CPU kernels: a GGUF file's Q4_1 and Q8_0 blocks multiplied at their own precision by activations
// quantised per block of 32 to int8 (llama.cpp's Q8_1 scheme), and the decoder layer loop around them, with each
// token's row computed on its own (a verify of K + 1 tokens gives the bits of K + 1 one-token steps).
//
// A block's product is an exact integer sum; blocks are accumulated in float32 with fused multiply-adds in a fixed
// order: for Q4_1 (weight = d * q + m)  acc = fma(isum, dw * dx, acc); acc = fma(mw, dx * sum xq, acc);
//         for Q8_0 (weight = d * q)      acc = fma(isum, dw * dx, acc).
// The AVX512-VNNI kernels and the portable loops run the same float operations in the same order: the same bits.
//
// Packing, 16 output rows at a time (one 512-bit lane per row), rows 16g..16g+15, block b:
//   Q4_1: 256 bytes = 4 chunks of 64; chunk c holds, for row r at bytes 4r..4r+3, the weights 4c..4c+3 (low
//         nibbles) and 4c+16..4c+19 (high nibbles); dm [N/16, K/32, 2, 16] float16: d and m of those rows.
//   Q8_0: 512 bytes = 8 chunks of 64; chunk j holds q + 128 of row r's weights 4j..4j+3 at bytes 4r..4r+3;
//         d [N/16, K/32, 16] float16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FLASHSPEC_VNNI 1
#else
#define FLASHSPEC_VNNI 0
#endif

namespace {

constexpr int64_t QK = 32;    // weights per block
constexpr int64_t ROWS = 16;  // output rows per packed group
constexpr int64_t TILE = 16;  // tokens whose accumulators stay in registers (one pass over the weights)

// ------------------------------------------------------------------------------------------------------------
// Activations: rows quantised per block of 32

struct Activations {
  int64_t T = 0, K = 0;       // rows, features
  std::vector<int8_t> q;      // [T, K]
  std::vector<float> d;       // [T, K / 32]: the block's scale, max |x| / 127
  std::vector<float> s;       // [T, K / 32]: d * sum of the block's q (Q4_1's m term)
  std::vector<int32_t> sum;   // [T, K / 32]: sum of the block's q (Q8_0's offset)

  Activations(int64_t T_, int64_t K_) : T(T_), K(K_), q(T_ * K_), d(T_ * K_ / QK), s(T_ * K_ / QK), sum(T_ * K_ / QK) {}

  // Block i (row i / (K / 32)) from 32 floats: q = round-half-even(v / d), q = 0 where d = 0.
  void set_block(int64_t i, const float* v, bool portable) {
    float scale;
    int32_t total;
#if FLASHSPEC_VNNI
    if (!portable) {
      const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
      scale = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))) / 127.f;
      const __m512 id = _mm512_set1_ps(scale != 0.f ? 1.f / scale : 0.f);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + i * QK), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + i * QK + 16), _mm512_cvtepi32_epi8(qb));
      total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    } else
#endif
    {
      float amax = 0.f;
      for (int64_t k = 0; k < QK; ++k) amax = std::max(amax, std::fabs(v[k]));
      scale = amax / 127.f;
      const float id = scale != 0.f ? 1.f / scale : 0.f;
      total = 0;
      for (int64_t k = 0; k < QK; ++k) {
        q[i * QK + k] = static_cast<int8_t>(std::nearbyint(v[k] * id));
        total += q[i * QK + k];
      }
    }
    d[i] = scale;
    s[i] = scale * static_cast<float>(total);
    sum[i] = total;
  }
};

// f(t0, t1) over rows [0, T) split between the threads from 4 rows on (fewer run inline: a parallel region costs
// more than it saves there). Each row's steps are its own, so the split changes no bits; it takes a verify's or a
// prompt's row preparation (norms, rotary, quantisation) off the one thread that otherwise runs it while the others
// wait for the next product.
template <typename F>
void rows_parallel(int64_t T, const F& f) {
  at::parallel_for(0, T, 3, f);
}

Activations quantize(const at::Tensor& x, bool portable) {  // x [T, K], any float dtype
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  Activations a(xf.size(0), xf.size(1));
  const float* src = xf.data_ptr<float>();
  const int64_t per_row = a.K / QK;
  rows_parallel(a.T, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0 * per_row; i < t1 * per_row; ++i) a.set_block(i, src + i * QK, portable);
  });
  return a;
}

// RMSNorm of one float32 row [K] scaled by w [K] (HF's x * rsqrt(mean(x^2) + eps) * w) into out.
void rms_row(const float* row, const float* w, int64_t K, double eps, float* out) {
  float ss = 0.f;
  for (int64_t k = 0; k < K; ++k) ss += row[k] * row[k];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(K) + static_cast<float>(eps));
  for (int64_t k = 0; k < K; ++k) out[k] = row[k] * inv * w[k];
}

// RMSNorm of the float32 rows x [T, K] scaled by w [K], then quantised.
Activations norm_quantize(const at::Tensor& x, const at::Tensor& w, double eps) {
  Activations a(x.size(0), x.size(1));
  const float* src = x.data_ptr<float>();
  const float* scale = w.data_ptr<float>();
  rows_parallel(a.T, [&](int64_t t0, int64_t t1) {
    std::vector<float> normed(a.K);
    for (int64_t t = t0; t < t1; ++t) {
      rms_row(src + t * a.K, scale, a.K, eps, normed.data());
      for (int64_t b = 0; b < a.K / QK; ++b) a.set_block(t * (a.K / QK) + b, normed.data() + b * QK, false);
    }
  });
  return a;
}

// The draft head's layer input: rows [RMSNorm(e) * we, RMSNorm(h) * wh] [T, 2K] of e, h [T, K] (float32), quantised.
Activations pair_norm_quantize(const at::Tensor& e, const at::Tensor& we, const at::Tensor& h, const at::Tensor& wh,
                               double eps) {
  const int64_t K = e.size(1);
  Activations a(e.size(0), 2 * K);
  const float *es = e.data_ptr<float>(), *hs = h.data_ptr<float>();
  const float *wes = we.data_ptr<float>(), *whs = wh.data_ptr<float>();
  rows_parallel(a.T, [&](int64_t t0, int64_t t1) {
    std::vector<float> normed(2 * K);
    for (int64_t t = t0; t < t1; ++t) {
      rms_row(es + t * K, wes, K, eps, normed.data());
      rms_row(hs + t * K, whs, K, eps, normed.data() + K);
      for (int64_t b = 0; b < 2 * K / QK; ++b) a.set_block(t * (2 * K / QK) + b, normed.data() + b * QK, false);
    }
  });
  return a;
}

// Attention's output o [B, KV, R*T, D] (C: bfloat16 or float; row r*T + t: query head kv*R + r of token t) as rows
// [B*T, H*D] in head order, quantised.
template <typename C>
Activations heads_quantize(const at::Tensor& o, int64_t T, int64_t R) {
  const int64_t B = o.size(0), KV = o.size(1), D = o.size(3), H = KV * R;
  Activations a(B * T, H * D);
  const C* src = o.data_ptr<C>();
  rows_parallel(B * T, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(H * D);
    for (int64_t bt = r0; bt < r1; ++bt) {
      const int64_t bb = bt / T, t = bt % T;
      for (int64_t h = 0; h < H; ++h) {
        const C* head = src + ((bb * KV + h / R) * R * T + (h % R) * T + t) * D;
        for (int64_t d = 0; d < D; ++d) row[h * D + d] = static_cast<float>(head[d]);
      }
      for (int64_t b = 0; b < H * D / QK; ++b) a.set_block(bt * (H * D / QK) + b, row.data() + b * QK, false);
    }
  });
  return a;
}

// SwiGLU's silu(gate) * up of gate_up [T, 2I] (float32), quantised as rows [T, I]. silu runs in place through
// aten (vectorised exp); the product and the quantisation here.
Activations silu_mul_quantize(at::Tensor& gate_up) {
  const int64_t I = gate_up.size(1) / 2;
  at::Tensor gate = gate_up.slice(1, 0, I);
  at::silu_(gate);
  Activations a(gate_up.size(0), I);
  const float* src = gate_up.data_ptr<float>();
  rows_parallel(a.T, [&](int64_t t0, int64_t t1) {
    float block[QK];
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t b = 0; b < I / QK; ++b) {
        const float* g = src + t * 2 * I + b * QK;
        for (int64_t k = 0; k < QK; ++k) block[k] = g[k] * g[I + k];
        a.set_block(t * (I / QK) + b, block, false);
      }
    }
  });
  return a;
}

// ------------------------------------------------------------------------------------------------------------
// Products: out[t, 16g..16g+15] = (or +=) rows 16g..16g+15 of W times row t of the activations

void store(float* out, const float* acc, bool accumulate) {
  for (int64_t r = 0; r < ROWS; ++r) out[r] = accumulate ? out[r] + acc[r] : acc[r];
}

void q4_1_group_portable(const uint8_t* w, const at::Half* dm, const Activations& a, int64_t t0, int64_t nt,
                         float* out, int64_t N, int64_t g, bool accumulate) {
  const int64_t K = a.K, B = K / QK;
  float acc[TILE][ROWS] = {};
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* wb = w + b * 256;
    const at::Half* dmb = dm + b * 2 * ROWS;
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t t = t0 + i;
      const int8_t* xq = a.q.data() + t * K + b * QK;
      for (int64_t r = 0; r < ROWS; ++r) {
        int32_t isum = 0;
        for (int64_t c = 0; c < 4; ++c) {
          for (int64_t j = 0; j < 4; ++j) {
            const uint8_t byte = wb[c * 64 + r * 4 + j];
            isum += static_cast<int32_t>(byte & 0x0F) * xq[c * 4 + j];
            isum += static_cast<int32_t>(byte >> 4) * xq[(c + 4) * 4 + j];
          }
        }
        acc[i][r] = std::fma(static_cast<float>(isum), static_cast<float>(dmb[r]) * a.d[t * B + b], acc[i][r]);
        acc[i][r] = std::fma(static_cast<float>(dmb[ROWS + r]), a.s[t * B + b], acc[i][r]);
      }
    }
  }
  for (int64_t i = 0; i < nt; ++i) store(out + (t0 + i) * N + g * ROWS, acc[i], accumulate);
}

void q8_0_group_portable(const uint8_t* w, const at::Half* dw, const Activations& a, int64_t t0, int64_t nt,
                         float* out, int64_t N, int64_t g, bool accumulate) {
  const int64_t K = a.K, B = K / QK;
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
  for (int64_t i = 0; i < nt; ++i) store(out + (t0 + i) * N + g * ROWS, acc[i], accumulate);
}

#if FLASHSPEC_VNNI
void store_vnni(float* out, __m512 acc, bool accumulate) {
  _mm512_storeu_ps(out, accumulate ? _mm512_add_ps(_mm512_loadu_ps(out), acc) : acc);
}

// One token's integer sums over a block: its 32 quantised activations xq against the block's 8 weight chunks q
// (16 rows each), in two chains of four products (a tile of more than 8 tokens runs token by token).
inline __m512i token_sums(const __m512i* q, const int8_t* xq) {
  const int32_t* x4 = reinterpret_cast<const int32_t*>(xq);
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int j = 0; j < 8; j += 2) {
    s0 = _mm512_dpbusd_epi32(s0, q[j], _mm512_set1_epi32(x4[j]));
    s1 = _mm512_dpbusd_epi32(s1, q[j + 1], _mm512_set1_epi32(x4[j + 1]));
  }
  return _mm512_add_epi32(s0, s1);
}

template <int64_t nt>  // tokens t0..t0+nt-1: a constant, so the accumulators live in registers
void q4_1_group_vnni(const uint8_t* w, const at::Half* dm, const Activations& a, int64_t t0, float* out, int64_t N,
                     int64_t g, bool accumulate) {
  const int64_t K = a.K, B = K / QK;
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
    if constexpr (nt > 8) {  // token by token, two chains of 4 products each (registers for 16 accumulators)
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = t0 + i;
        const __m512i isum = token_sums(q, a.q.data() + t * K + b * QK);
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[t * B + b]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[i]);
        acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[t * B + b]), acc[i]);
      }
      continue;
    }
    constexpr int chains = nt < 5 ? 2 : 1;  // dependent dot products per token; enough tokens hide the latency
    __m512i s[nt][chains];
    for (int64_t i = 0; i < nt; ++i)
      for (int c = 0; c < chains; ++c) s[i][c] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      for (int64_t i = 0; i < nt; ++i) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(a.q.data() + (t0 + i) * K + b * QK);
        s[i][j % chains] = _mm512_dpbusd_epi32(s[i][j % chains], q[j], _mm512_set1_epi32(xq[j]));
      }
    }
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t t = t0 + i;
      const __m512i isum = chains == 2 ? _mm512_add_epi32(s[i][0], s[i][chains - 1]) : s[i][0];
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[t * B + b]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[i]);
      acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[t * B + b]), acc[i]);
    }
  }
  for (int64_t i = 0; i < nt; ++i) store_vnni(out + (t0 + i) * N + g * ROWS, acc[i], accumulate);
}

template <int64_t nt>
void q8_0_group_vnni(const uint8_t* w, const at::Half* dw, const Activations& a, int64_t t0, float* out, int64_t N,
                     int64_t g, bool accumulate) {
  const int64_t K = a.K, B = K / QK;
  __m512 acc[nt];
  for (int64_t i = 0; i < nt; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* wb = w + b * 512;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dw + b * ROWS)));
    if constexpr (nt > 8) {  // token by token (as q4_1_group_vnni), the block's 8 chunks in registers
      __m512i q[8];
      for (int j = 0; j < 8; ++j) q[j] = _mm512_loadu_si512(wb + j * 64);
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = t0 + i;
        const __m512i sums = token_sums(q, a.q.data() + t * K + b * QK);
        const __m512i isum = _mm512_sub_epi32(sums, _mm512_set1_epi32(128 * a.sum[t * B + b]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(a.d[t * B + b])), acc[i]);
      }
      continue;
    }
    constexpr int chains = nt < 5 ? 2 : 1;
    __m512i s[nt][chains];
    for (int64_t i = 0; i < nt; ++i)
      for (int c = 0; c < chains; ++c) s[i][c] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i q = _mm512_loadu_si512(wb + j * 64);
      for (int64_t i = 0; i < nt; ++i) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(a.q.data() + (t0 + i) * K + b * QK);
        s[i][j % chains] = _mm512_dpbusd_epi32(s[i][j % chains], q, _mm512_set1_epi32(xq[j]));
      }
    }
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t t = t0 + i;
      const __m512i isum = chains == 2 ? _mm512_add_epi32(s[i][0], s[i][chains - 1]) : s[i][0];
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum, _mm512_set1_epi32(128 * a.sum[t * B + b]))),
                               _mm512_mul_ps(d, _mm512_set1_ps(a.d[t * B + b])), acc[i]);
    }
  }
  for (int64_t i = 0; i < nt; ++i) store_vnni(out + (t0 + i) * N + g * ROWS, acc[i], accumulate);
}
#endif

using GroupKernel = void (*)(const uint8_t*, const at::Half*, const Activations&, int64_t, float*, int64_t, int64_t,
                             bool);

// {kernel<1>, ..., kernel<n>} from make(std::integral_constant<n>) (each count a constant: accumulators in registers)
template <typename Make, int64_t... n>
std::vector<GroupKernel> kernels(Make make, std::integer_sequence<int64_t, n...>) {
  return {make(std::integral_constant<int64_t, n + 1>{})...};
}

enum class Format { Q4_1, Q8_0 };

#if FLASHSPEC_VNNI
// The VNNI group kernels of a format by token count (index nt - 1).
const std::vector<GroupKernel>& vnni_kernels(Format format) {
  constexpr auto counts = std::make_integer_sequence<int64_t, TILE>{};
  static const std::vector<GroupKernel> q4_1 =
      kernels([](auto n) -> GroupKernel { return q4_1_group_vnni<decltype(n)::value>; }, counts);
  static const std::vector<GroupKernel> q8_0 =
      kernels([](auto n) -> GroupKernel { return q8_0_group_vnni<decltype(n)::value>; }, counts);
  return format == Format::Q4_1 ? q4_1 : q8_0;
}
#endif

// out [T, N] (float32, contiguous) = or += W times the activations; W packed as `format` with its scales.
void matmul(Format format, const Activations& a, const at::Tensor& packed, const at::Tensor& scales, float* out,
            bool accumulate, bool portable) {
  const int64_t G = packed.size(0), N = G * ROWS, B = a.K / QK, T = a.T;
  const int64_t bytes = format == Format::Q4_1 ? 256 : 512, halves = format == Format::Q4_1 ? 2 * ROWS : ROWS;
  TORCH_CHECK(a.K == packed.size(1) * QK, "the activations have K = ", a.K, " but the weights ", packed.size(1) * QK);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = w + g * B * bytes;
      const at::Half* sg = sc + g * B * halves;
      // ceil(T / TILE) tiles of near-equal size (17 tokens: 9 + 8, not 16 + 1, whose lone token waits on its chains);
      // a token's sums are its own in any tile, so the split changes no bits
      const int64_t tiles = (T + TILE - 1) / TILE;
      for (int64_t k = 0, next = 0; k < tiles; ++k) {
        const int64_t nt = T / tiles + (k < T % tiles), t0 = next;
        next += nt;
#if FLASHSPEC_VNNI
        if (!portable) {
          vnni_kernels(format)[nt - 1](wg, sg, a, t0, out, N, g, accumulate);
          continue;
        }
#endif
        if (format == Format::Q4_1) q4_1_group_portable(wg, sg, a, t0, nt, out, N, g, accumulate);
        else q8_0_group_portable(wg, sg, a, t0, nt, out, N, g, accumulate);
      }
    }
  });
}

at::Tensor linear(Format format, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                  bool portable) {
  TORCH_CHECK(x.dim() == 2, "x must be [T, K], got ", x.sizes());
  const int64_t bytes = format == Format::Q4_1 ? 256 : 512;
  TORCH_CHECK(packed.dtype() == at::kByte && packed.dim() == 3 && packed.size(2) == bytes && packed.is_contiguous(),
              "packed must be contiguous uint8 [N/16, K/32, ", bytes, "]");
  TORCH_CHECK(scales.dtype() == at::kHalf && scales.is_contiguous(), "scales must be contiguous float16");
  TORCH_CHECK(x.size(1) == packed.size(1) * QK, "x has K = ", x.size(1), " but the weights ", packed.size(1) * QK);
  const Activations a = quantize(x, portable);
  at::Tensor out = at::empty({a.T, packed.size(0) * ROWS}, x.options().dtype(at::kFloat));
  matmul(format, a, packed, scales, out.data_ptr<float>(), false, portable);
  return out;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm) {
  return linear(Format::Q4_1, x, packed, dm, false);
}
at::Tensor q4_1_linear_portable(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm) {
  return linear(Format::Q4_1, x, packed, dm, true);
}
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d) {
  return linear(Format::Q8_0, x, packed, d, false);
}
at::Tensor q8_0_linear_portable(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d) {
  return linear(Format::Q8_0, x, packed, d, true);
}

bool vnni() { return FLASHSPEC_VNNI; }

// ------------------------------------------------------------------------------------------------------------
// The decoder layers

// Where rope_scatter writes: q [B, KV, R*T, D] (row r*T + t of kv head g: query head g*R + r of token t); k and v
// [B, KV, capacity, D], at the tokens' cache slots. C: bfloat16 (the target's cache) or float (the draft head's).
template <typename C>
struct Heads {
  C *q, *k, *v;
  int64_t capacity;
};

inline void store_row(const float* x, int64_t D, at::BFloat16* dst) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<at::BFloat16>(x[d]);
}
inline void store_row(const float* x, int64_t D, float* dst) { std::memcpy(dst, x, D * sizeof(float)); }

// Rotary embedding of q and k from the float32 projections qkv [B*T, (H + 2 KV) * D] (cos, sin [T, D] float32, sin
// carrying rotate_half's sign: x * cos + swap_halves(x) * sin), each rounded once to C, into `to` at slots pos [T].
template <typename C>
void rope_scatter(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pos,
                  const Heads<C>& to, int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D) {
  const int64_t R = H / KV, half = D / 2, width = (H + 2 * KV) * D, cap = to.capacity;
  const float* src = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t* slot = pos.data_ptr<int64_t>();
  rows_parallel(B * T, [&](int64_t r0, int64_t r1) {
    std::vector<float> rotated(D);
    for (int64_t bt = r0; bt < r1; ++bt) {
      const int64_t bb = bt / T, t = bt % T;
      const float* row = src + bt * width;
      const float* ct = c + t * D;
      const float* st = s + t * D;
      for (int64_t h = 0; h < H + 2 * KV; ++h) {
        const float* x = row + h * D;
        C* dst;
        if (h < H) dst = to.q + ((bb * KV + h / R) * R * T + (h % R) * T + t) * D;
        else if (h < H + KV) dst = to.k + ((bb * KV + (h - H)) * cap + slot[t]) * D;
        else dst = to.v + ((bb * KV + (h - H - KV)) * cap + slot[t]) * D;
        if (h >= H + KV) {
          store_row(x, D, dst);
          continue;
        }
        for (int64_t d = 0; d < half; ++d) rotated[d] = x[d] * ct[d] + x[d + half] * st[d];
        for (int64_t d = half; d < D; ++d) rotated[d] = x[d] * ct[d] + x[d - half] * st[d];
        store_row(rotated.data(), D, dst);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------------------
// Attention in the keys' own order
//
// Every sum runs over the cache slots in slot order, and the slots a query's mask hides add exact zeros: a token's
// output depends on which keys it sees, never on where they sit in the cache or on how many queries share the call. So a draft tree (a node's ancestors at scattered slots) gives the bits of one-token steps
// along the node's path, as a chain verify does.

// 16 float32 lanes as a GCC/Clang vector (one 512-bit register with AVX-512): every lane computes alike, so a value
// does not depend on the lane it sits in. Built with -ffp-contract=off: a * b + c rounds twice unless written as
// fmadd (one rounding, on every path).
typedef float floats __attribute__((vector_size(64)));
typedef int32_t ints __attribute__((vector_size(64)));
typedef uint16_t shorts __attribute__((vector_size(32)));
constexpr int64_t LANES = 16;

#if defined(__clang__)
#define FLASHSPEC_MIX(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define FLASHSPEC_MIX(a, b, ...) __builtin_shuffle(a, b, ints{__VA_ARGS__})
#endif

inline floats splat(float x) {  // x in every lane (one broadcast; floats{} + x also added +0)
#if defined(__AVX512F__)
  return (floats)_mm512_set1_ps(x);
#else
  return floats{} + x;
#endif
}

inline floats fmadd(floats a, floats b, floats c) {  // a * b + c, rounded once
#if defined(__AVX512F__)
  return (floats)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  floats r;
  for (int64_t l = 0; l < LANES; ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
#endif
}

inline floats widen(const float* p) {
  floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline floats widen(const at::BFloat16* p) {  // 16 bfloat16 -> float32 (their bits are a float's high half)
  shorts h;
  std::memcpy(&h, p, sizeof h);
  return (floats)(__builtin_convertvector(h, ints) << 16);
}

// The 16 x 16 block held as rows r[0..15], transposed in place: four stages, each swapping the off-diagonal halves of
// the blocks of 2s x 2s (s = 8, 4, 2, 1) between rows s apart.
inline void transpose16(floats* r) {
#define FLASHSPEC_STAGE(s, LO, HI)                                  \
  for (int64_t i = 0; i < LANES; ++i) {                             \
    if (i & s) continue;                                            \
    const floats a = r[i], b = r[i + s];                            \
    r[i] = FLASHSPEC_MIX(a, b, LO);                                 \
    r[i + s] = FLASHSPEC_MIX(a, b, HI);                             \
  }
#define FLASHSPEC_L(...) __VA_ARGS__
  FLASHSPEC_STAGE(8, FLASHSPEC_L(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                  FLASHSPEC_L(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
  FLASHSPEC_STAGE(4, FLASHSPEC_L(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                  FLASHSPEC_L(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
  FLASHSPEC_STAGE(2, FLASHSPEC_L(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                  FLASHSPEC_L(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
  FLASHSPEC_STAGE(1, FLASHSPEC_L(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                  FLASHSPEC_L(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#undef FLASHSPEC_L
#undef FLASHSPEC_STAGE
}

// exp(x) lane by lane for a softmax's shifted scores x <= 0: x = n ln2 + r (Cody-Waite, ln2's high part exact
// for |n| < 512), e^r by its degree-6 Taylor polynomial (|r| <= ln2 / 2, relative error < 2e-7), times 2^n; x below
// -87 is clamped there (~1.6e-38).
inline floats exp_nonpositive(floats x) {
  const floats floor = splat(-87.f);
  x = x < floor ? floor : x;
  const floats n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round(x / ln 2)
  const floats r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  floats p = splat(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = p * r + c;
  return p * (floats)((__builtin_convertvector(n, ints) + 127) << 23);
}

template <typename C>
struct Attention {
  Heads<C> in;                // q, and the cache's k and v
  C* o;                       // [B, KV, R*T, D], like q
  const uint8_t* visible;     // [T, S]: 1 where token t reads slot s
  int64_t KV, R, T, D, S;
  float scale;
};

constexpr int64_t TOKENS = 8;  // tokens of one kv head attended together (one work item)
constexpr int64_t QUERIES = 4;  // queries scored together against a block of 16 keys

// The first n cache slots of one kv head, widened to float32: keys transposed in blocks of 16 (kt[b * D + d]:
// feature d of slots 16b..16b+15, zeros past n) and values as rows (v[i * D / 16 + c]). Views: the floats live in
// `Widened`'s storage.
struct Keys {
  const floats *kt, *v;
  int64_t n, width;  // slots, and slots rounded up to a multiple of 16
};

// Slots [from, n) of one kv head's cache (keys k, values; rows of D) widened into kt and v laid out as in Keys; the
// block of 16 that holds `from` is redone whole, and its slots past n are zeros.
template <typename C>
void widen_slots(const C* k, const C* values, int64_t from, int64_t n, int64_t D, floats* kt, floats* v) {
  const int64_t chunks = D / LANES;
  floats rows[LANES];
  for (int64_t b = from / LANES; b < (n + LANES - 1) / LANES; ++b)
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t l = 0; l < LANES; ++l)
        rows[l] = b * LANES + l < n ? widen(k + (b * LANES + l) * D + c * LANES) : floats{};
      transpose16(rows);
      for (int64_t d = 0; d < LANES; ++d) kt[b * D + c * LANES + d] = rows[d];
    }
  for (int64_t i = from; i < n; ++i)
    for (int64_t c = 0; c < chunks; ++c) v[i * chunks + c] = widen(values + i * D + c * LANES);
}

// Where the widened keys and values of each (row, kv head) live: `slots` slots a head (a multiple of 16), its keys at
// kt + head * slots * D / 16 and values at v + the same. Either kept across calls (the target's float32 copy of its
// cache, whose first `valid` slots are current) or this call's own (valid = 0).
struct Widened {
  floats *kt, *v;
  int64_t slots, valid;
};

// score [rows, width]: scale * q . k of each query (q [rows rounded up to QUERIES, D]; query j of token j % nt) and
// slot, plus the token's bias (bias [nt, width]: 0 where it sees the slot, else -inf). Each score is one chain of
// fused multiply-adds over d in order, whichever lane, block or group of queries computes it; two blocks of keys
// and QUERIES queries at a time give the multiply-adders eight independent chains.
void scores(const float* q, int64_t rows, int64_t nt, const Keys& keys, const float* bias, int64_t D, float scale,
            float* score) {
  const int64_t blocks = keys.width / LANES;
  for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
    const int64_t nb = std::min<int64_t>(2, blocks - b0);
    for (int64_t j0 = 0; j0 < rows; j0 += QUERIES) {
      floats acc[2][QUERIES] = {};
      for (int64_t d = 0; d < D; ++d) {
        const floats k0 = keys.kt[b0 * D + d], k1 = nb == 2 ? keys.kt[(b0 + 1) * D + d] : floats{};
        for (int64_t r = 0; r < QUERIES; ++r) {
          const floats x = splat(q[(j0 + r) * D + d]);
          acc[0][r] = fmadd(x, k0, acc[0][r]);
          acc[1][r] = fmadd(x, k1, acc[1][r]);
        }
      }
      for (int64_t h = 0; h < nb; ++h)
        for (int64_t r = 0; r < QUERIES && j0 + r < rows; ++r) {
          const int64_t at = (b0 + h) * LANES;
          const floats x = acc[h][r] * scale + widen(bias + ((j0 + r) % nt) * keys.width + at);
          std::memcpy(&score[(j0 + r) * keys.width + at], &x, sizeof x);
        }
    }
  }
}

// Softmax of one query's scores row [width], in place: the weights, exact zeros where it sees no key.
void softmax_row(float* row, const Keys& keys) {
  floats top = splat(-INFINITY);
  for (int64_t i = 0; i < keys.width; i += LANES) {
    const floats x = widen(row + i);
    top = x > top ? x : top;
  }
  float m = top[0];
  for (int64_t l = 1; l < LANES; ++l) m = std::max(m, top[l]);
  for (int64_t i = 0; i < keys.width; i += LANES) {
    const floats x = widen(row + i);
    const floats p = x == splat(-INFINITY) ? floats{} : exp_nonpositive(x - m);
    std::memcpy(row + i, &p, sizeof p);
  }
}

// The outputs of n <= 2 queries from their weight rows: each the weighted values summed over the keys in order, over
// the weights' sum (also in order) -> outs[j] [D]. Two queries side by side give the multiply-adders independent
// chains; each query's sums are its own, in the same order as alone. CH = D / 16 is a constant, so the sums stay in
// registers (with D a variable they went through memory at every key).
template <int CH>
void weighted_values(float* const* rows, int64_t n, const Keys& keys, float* const* outs) {
  float total0 = 0.f, total1 = 0.f;
  floats acc0[CH] = {}, acc1[CH] = {};
  const float *w0 = rows[0], *w1 = rows[n - 1];
  // a hidden key's weight is an exact zero: it adds +0 or -0 to sums that start at +0, changing no bit
  for (int64_t i = 0; i < keys.n; ++i) {
    const floats* v = keys.v + i * CH;
    const floats p0 = splat(w0[i]), p1 = splat(w1[i]);
    total0 += w0[i];
    total1 += w1[i];
    for (int c = 0; c < CH; ++c) {
      acc0[c] = fmadd(p0, v[c], acc0[c]);
      acc1[c] = fmadd(p1, v[c], acc1[c]);
    }
  }
  const float inv0 = total0 > 0.f ? 1.f / total0 : 0.f, inv1 = total1 > 0.f ? 1.f / total1 : 0.f;
  for (int c = 0; c < CH; ++c) {
    const floats x0 = acc0[c] * inv0, x1 = acc1[c] * inv1;
    std::memcpy(outs[0] + c * LANES, &x0, sizeof x0);
    if (n == 2) std::memcpy(outs[1] + c * LANES, &x1, sizeof x1);
  }
}

void weighted_values(float* const* rows, int64_t n, const Keys& keys, int64_t D, float* const* outs) {
  switch (D / LANES) {  // D is a multiple of 16 up to 128 (gguf_layers and head_layer check)
    case 1: return weighted_values<1>(rows, n, keys, outs);
    case 2: return weighted_values<2>(rows, n, keys, outs);
    case 3: return weighted_values<3>(rows, n, keys, outs);
    case 4: return weighted_values<4>(rows, n, keys, outs);
    case 5: return weighted_values<5>(rows, n, keys, outs);
    case 6: return weighted_values<6>(rows, n, keys, outs);
    case 7: return weighted_values<7>(rows, n, keys, outs);
    default: return weighted_values<8>(rows, n, keys, outs);
  }
}

// Tokens [t0, t0 + nt) of kv head g, row bb, with their R query heads each: softmax(scale * q k^T) v over the slots of
// `keys` (that head's) each token sees. Every sum runs over the slots in order and the slots a query does not see add
// exact zeros, so a query's output is that of its own visible keys in slot order, whoever shares the call.
template <typename C>
void attend_tokens(const Attention<C>& a, const Keys& keys, int64_t bb, int64_t g, int64_t t0, int64_t nt) {
  // query j: query head j / nt of token t0 + j % nt
  const int64_t D = a.D, rows = a.R * nt, head = (bb * a.KV + g) * a.R * a.T;
  auto query_row = [&](int64_t j) { return head + (j / nt) * a.T + t0 + j % nt; };
  thread_local std::vector<float> q, bias, score, out;  // a thread's buffers, kept: no allocation per work item
  q.assign((rows + QUERIES - 1) / QUERIES * QUERIES * D, 0.f);
  bias.assign(nt * keys.width, -INFINITY);
  score.resize(rows * keys.width);
  out.resize(2 * D);
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t d = 0; d < D; ++d) q[j * D + d] = static_cast<float>(a.in.q[query_row(j) * D + d]);
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t i = 0; i < keys.n; ++i)
      if (a.visible[(t0 + t) * a.S + i]) bias[t * keys.width + i] = 0.f;
  scores(q.data(), rows, nt, keys, bias.data(), D, a.scale, score.data());
  for (int64_t j0 = 0; j0 < rows; j0 += 2) {
    const int64_t n = std::min<int64_t>(2, rows - j0);
    float* weights[2] = {&score[j0 * keys.width], &score[(j0 + n - 1) * keys.width]};
    float* outs[2] = {out.data(), out.data() + D};
    for (int64_t j = 0; j < n; ++j) softmax_row(weights[j], keys);
    weighted_values(weights, n, keys, D, outs);
    for (int64_t j = 0; j < n; ++j) store_row(outs[j], D, a.o + query_row(j0 + j) * D);
  }
}

// Every (row, kv head, block of up to TOKENS tokens) of `a`, spread over the threads: first each head's slots up to
// the last any token sees widened where `wide` does not hold them yet, then the blocks of tokens.
template <typename C>
void ordered_attention(const Attention<C>& a, int64_t B, const Widened& wide) {
  int64_t n = 0;
  for (int64_t t = 0; t < a.T; ++t)
    for (int64_t s = n; s < a.S; ++s)
      if (a.visible[t * a.S + s]) n = s + 1;
  TORCH_CHECK(n <= wide.slots, "the widened keys hold ", wide.slots, " slots a head; ", n, " are visible");
  const int64_t from = std::min(wide.valid, n), head = wide.slots * a.D / LANES;
  at::parallel_for(0, B * a.KV, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t base = i * a.in.capacity * a.D;
      widen_slots(a.in.k + base, a.in.v + base, from, n, a.D, wide.kt + i * head, wide.v + i * head);
    }
  });
  // blocks of near-equal size, enough of them that the threads get as many (9 tokens, 3 kv heads, 2 threads: 5 + 4
  // tokens a head, 3 blocks a thread; 8 + 1 gave one thread 17 tokens' work and the other 10)
  int64_t blocks = (a.T + TOKENS - 1) / TOKENS;
  while ((B * a.KV * blocks) % at::get_num_threads() && blocks < a.T) ++blocks;
  at::parallel_for(0, B * a.KV * blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t k = i % blocks, h = i / blocks, t0 = k * (a.T / blocks) + std::min(k, a.T % blocks);
      const Keys keys{wide.kt + h * head, wide.v + h * head, n, (n + LANES - 1) / LANES * LANES};
      attend_tokens(a, keys, h / a.KV, h % a.KV, t0, a.T / blocks + (k < a.T % blocks));
    }
  });
}

// This call's own storage for `heads` kv heads of up to n slots: reused by the calling thread's next calls.
Widened scratch(int64_t heads, int64_t n, int64_t D) {
  thread_local std::vector<floats> kt, v;
  const int64_t slots = (n + LANES - 1) / LANES * LANES, size = heads * slots * D / LANES;
  if (static_cast<int64_t>(kt.size()) < size) kt.resize(size), v.resize(size);
  return Widened{kt.data(), v.data(), slots, 0};
}

// Layer i's storage in `wide` (each layer's [2, B, KV, slots, D] float32: kt, then v), its first `valid` slots
// current; `wide` empty: this call's scratch.
Widened widened_in(at::TensorList wide, int64_t i, int64_t valid, int64_t heads, int64_t S, int64_t D) {
  if (wide.empty()) return scratch(heads, S, D);
  const at::Tensor& t = wide[i];
  TORCH_CHECK(t.is_contiguous() && t.dtype() == at::kFloat && t.size(0) == 2 && t.size(1) * t.size(2) == heads &&
              t.size(3) % LANES == 0 && t.size(4) == D, "wide: contiguous float32 [2, B, KV, slots (x16), D] a layer");
  floats* kt = reinterpret_cast<floats*>(t.data_ptr<float>());
  return Widened{kt, kt + t.numel() / 2 / LANES, t.size(3), valid};
}

// StaticCausalLM's layers on the GGUF path: x [B*T, hidden] float32, updated in place, with cos, sin [T, 1, D] at
// the tokens' rotary positions; K/V written to cache slots pos [T] of kv_cache[i] [2, B, KV, capacity, D]
// (bfloat16); attention over slots [0, S) through the additive mask [R*T, S] (0 or -inf, the same for each query
// head r of token t): SDPA, or (ordered) `ordered_attention` over the slots the mask leaves visible. weights: 10 per
// layer (input norm, q/k/v packed and dm, o packed and dm, post norm, gate/up packed and dm, down packed and dm;
// norms float32). wide: empty, or per layer the float32 copy of its cache that ordered attention reads ([2, B, KV,
// capacity, D], see Widened), whose first `valid` slots are current (the caller lowers it where slots change).
// Returns the residual streams entering the aux layers, in their order.
std::vector<at::Tensor> gguf_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pos,
                                    const at::Tensor& mask, int64_t S, at::IntArrayRef shape, double eps,
                                    double scaling, at::TensorList weights, at::TensorList kv_cache,
                                    at::IntArrayRef aux_layers, bool ordered, at::TensorList wide, int64_t valid) {
  const int64_t B = shape[0], T = shape[1], H = shape[2], KV = shape[3], D = shape[4], R = H / KV;
  const int64_t layers = static_cast<int64_t>(kv_cache.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 10 * layers, "10 weights per layer expected");
  TORCH_CHECK(x.is_contiguous() && x.dtype() == at::kFloat, "x must be contiguous float32");
  TORCH_CHECK(D % LANES == 0 && D <= 128 && (H * D) % QK == 0,
              "head_dim must be a multiple of 16 up to 128 and hidden of 32");
  const at::Tensor cos_f = cos.reshape({T, D}).to(at::kFloat).contiguous();
  const at::Tensor sin_f = sin.reshape({T, D}).to(at::kFloat).contiguous();
  const at::Tensor slots = pos.to(at::kLong).contiguous();
  std::vector<at::Tensor> saved(aux_layers.size());
  at::Tensor q = at::empty({B, KV, R * T, D}, x.options().dtype(at::kBFloat16));
  at::Tensor o = at::empty_like(q);
  const at::Tensor visible = ordered ? mask.slice(0, 0, T).slice(1, 0, S).isfinite().to(at::kByte).contiguous()
                                     : at::Tensor();  // [T, S]
  at::Tensor qkv = at::empty({B * T, (H + 2 * KV) * D}, x.options());
  at::Tensor gate_up;
  float* residual = x.data_ptr<float>();
  for (int64_t i = 0; i < layers; ++i) {
    for (size_t j = 0; j < aux_layers.size(); ++j)
      if (aux_layers[j] == i) saved[j] = x.clone();
    const at::Tensor* w = weights.data() + 10 * i;
    at::Tensor cache = kv_cache[i];
    matmul(Format::Q4_1, norm_quantize(x, w[0], eps), w[1], w[2], qkv.data_ptr<float>(), false, false);
    const Heads<at::BFloat16> heads{q.data_ptr<at::BFloat16>(), cache[0].data_ptr<at::BFloat16>(),
                                    cache[1].data_ptr<at::BFloat16>(), cache.size(3)};
    rope_scatter(qkv, cos_f, sin_f, slots, heads, B, T, H, KV, D);
    if (ordered) {
      ordered_attention(Attention<at::BFloat16>{heads, o.data_ptr<at::BFloat16>(), visible.data_ptr<uint8_t>(), KV, R,
                                                T, D, S, static_cast<float>(scaling)},
                        B, widened_in(wide, i, valid, B * KV, S, D));
    } else {
      o = at::scaled_dot_product_attention(q, cache[0].slice(2, 0, S), cache[1].slice(2, 0, S), mask, 0.0, false,
                                           scaling).contiguous();
    }
    matmul(Format::Q4_1, heads_quantize<at::BFloat16>(o, T, R), w[3], w[4], residual, true, false);
    const Activations h = norm_quantize(x, w[5], eps);
    if (!gate_up.defined()) gate_up = at::empty({B * T, w[6].size(0) * ROWS}, x.options());
    matmul(Format::Q4_1, h, w[6], w[7], gate_up.data_ptr<float>(), false, false);
    matmul(Format::Q4_1, silu_mul_quantize(gate_up), w[8], w[9], residual, true, false);
  }
  return saved;
}


// The draft head's layer (`draft_head.DraftHead.step`) on Q8_0 weights, float32 throughout: the tokens' embeddings e
// and the hidden states h [B*T, hidden]; rope [2, T, D] (cos, and sin signed as rope_scatter takes it); K/V written
// at slots pos [T] of cache = (k, v) [B, KV, capacity, D]; attention over the slots of [0, S) that visible [T, S]
// shows, in slot order. shape = (B, T, heads, kv heads, D); weights (11): input norm, hidden norm, q/k/v packed and
// d, o packed and d, post norm, gate/up packed and d, down packed and d. Returns the pre-norm output [B*T, hidden].
at::Tensor head_layer(const at::Tensor& e, const at::Tensor& h, const at::Tensor& rope, const at::Tensor& pos,
                      const at::Tensor& visible, at::IntArrayRef shape, double eps, double scaling,
                      at::TensorList weights, at::TensorList cache) {
  const int64_t B = shape[0], T = shape[1], H = shape[2], KV = shape[3], D = shape[4], R = H / KV;
  TORCH_CHECK(weights.size() == 11 && cache.size() == 2, "11 weights and the (k, v) cache expected");
  TORCH_CHECK(D % LANES == 0 && D <= 128 && (H * D) % QK == 0,
              "head_dim must be a multiple of 16 up to 128 and hidden of 32");
  for (const at::Tensor* x : {&e, &h, &rope, &cache[0], &cache[1]})
    TORCH_CHECK(x->is_contiguous() && x->dtype() == at::kFloat, "inputs and cache must be contiguous float32");
  TORCH_CHECK(visible.dtype() == at::kByte && visible.is_contiguous() && visible.size(0) == T, "visible: uint8 [T, S]");
  TORCH_CHECK(pos.dtype() == at::kLong && pos.is_contiguous() && pos.numel() == T, "pos: int64 [T]");
  const at::Tensor* w = weights.data();
  at::Tensor qkv = at::empty({B * T, (H + 2 * KV) * D}, h.options());
  matmul(Format::Q8_0, pair_norm_quantize(e, w[0], h, w[1], eps), w[2], w[3], qkv.data_ptr<float>(), false, false);
  at::Tensor q = at::empty({B, KV, R * T, D}, h.options()), o = at::empty_like(q);
  const Heads<float> heads{q.data_ptr<float>(), cache[0].data_ptr<float>(), cache[1].data_ptr<float>(),
                           cache[0].size(2)};
  rope_scatter(qkv, rope[0], rope[1], pos, heads, B, T, H, KV, D);
  ordered_attention(Attention<float>{heads, o.data_ptr<float>(), visible.data_ptr<uint8_t>(), KV, R, T, D,
                                     visible.size(1), static_cast<float>(scaling)},
                    B, scratch(B * KV, visible.size(1), D));
  at::Tensor out = h.clone();
  matmul(Format::Q8_0, heads_quantize<float>(o, T, R), w[4], w[5], out.data_ptr<float>(), true, false);
  at::Tensor gate_up = at::empty({B * T, w[7].size(0) * ROWS}, h.options());
  matmul(Format::Q8_0, norm_quantize(out, w[6], eps), w[7], w[8], gate_up.data_ptr<float>(), false, false);
  matmul(Format::Q8_0, silu_mul_quantize(gate_up), w[9], w[10], out.data_ptr<float>(), true, false);
  return out;
}

}  // namespace

TORCH_LIBRARY(flashspec, m) {
  m.def("q4_1_linear(Tensor x, Tensor packed, Tensor dm) -> Tensor");
  m.def("q4_1_linear_portable(Tensor x, Tensor packed, Tensor dm) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor packed, Tensor d) -> Tensor");
  m.def("q8_0_linear_portable(Tensor x, Tensor packed, Tensor d) -> Tensor");
  m.def("vnni() -> bool", &vnni);  // whether the AVX512-VNNI kernels were compiled in
  m.def("gguf_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor pos, Tensor mask, int S, int[] shape, float eps, "
        "float scaling, Tensor[] weights, Tensor(b!)[] kv_cache, int[] aux_layers, bool ordered, Tensor(c!)[] wide, "
        "int valid) -> Tensor[]");
  m.def("head_layer(Tensor e, Tensor h, Tensor rope, Tensor pos, Tensor visible, int[] shape, float eps, float scaling, "
        "Tensor[] weights, Tensor(a!)[] cache) -> Tensor");
}

TORCH_LIBRARY_IMPL(flashspec, CPU, m) {
  m.impl("q4_1_linear", q4_1_linear);
  m.impl("q4_1_linear_portable", q4_1_linear_portable);
  m.impl("q8_0_linear", q8_0_linear);
  m.impl("q8_0_linear_portable", q8_0_linear_portable);
  m.impl("gguf_layers", gguf_layers);
  m.impl("head_layer", head_layer);
}
