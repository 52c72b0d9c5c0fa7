// pdserve: CPU matrix-vector products that read GGUF Q4_1 / Q8_0 weight blocks directly.
//
// Weights stay in their packed block form (split into separate arrays per field); each block
// of 32 weights is expanded to fp32 in registers and multiplied with fp32 activations, with
// fp32 accumulation. The expanded weight values are bit-identical to the dequantized tensors
// of engine/loader/dequant.py:
//   Q4_1: w = d * q + m   q in [0, 15]; d * q is exact in fp32 (4-bit q times an fp16 d),
//                         so one fused multiply-add rounds exactly like "mul, then add".
//   Q8_0: w = d * q       q in [-128, 127]; the product is exact in fp32.
// Only the order of the sums differs from a dense matmul.
//
// Layouts (row-major, one row = one output feature, K = in_features, K % 32 == 0):
//   Q4_1: qs uint8 [N, K/2]  (16 bytes per block: low nibbles = weights 0..15 of the block,
//                             high nibbles = weights 16..31), d, m float32 [N, K/32]
//   Q8_0: qs int8 [N, K], d float32 [N, K/32]
// x float32 [M, K] (contiguous), out float32 [M, N]. Meant for small M (decode).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDS_AVX2 1
#else
#define PDS_AVX2 0
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kMaxMB = 4;  // activation rows handled per pass over a weight row

#if PDS_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Accumulators per activation row: enough independent FMA chains to hide latency while
// keeping MB * NA + 4 weight registers under the 16 ymm registers.
template <int MB>
struct Acc {
  static constexpr int NA = MB == 1 ? 4 : (MB == 2 ? 2 : 1);
};

// One weight row (Q4_1) against MB activation rows.
template <int MB>
inline void q4_1_row(const float* x, int64_t K, const uint8_t* qs, const float* d,
                     const float* m, float* out, int64_t ldo) {
  constexpr int NA = Acc<MB>::NA;
  __m256 acc[MB][NA];
  for (int r = 0; r < MB; ++r)
    for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  const int64_t nb = K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m256 vd = _mm256_set1_ps(d[b]);
    const __m256 vm = _mm256_set1_ps(m[b]);
    __m256 w[4];
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vd, vm);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vd, vm);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vd, vm);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vd, vm);
    const float* xb = x + b * kBlock;
    for (int r = 0; r < MB; ++r) {
      const float* xr = xb + r * K;
      for (int j = 0; j < 4; ++j)
        acc[r][j % NA] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * j), w[j], acc[r][j % NA]);
    }
  }
  for (int r = 0; r < MB; ++r) {
    __m256 s = acc[r][0];
    for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[r][a]);
    out[r * ldo] = hsum(s);
  }
}

template <int MB>
inline void q8_0_row(const float* x, int64_t K, const int8_t* qs, const float* d, float* out,
                     int64_t ldo) {
  constexpr int NA = Acc<MB>::NA;
  __m256 acc[MB][NA];
  for (int r = 0; r < MB; ++r)
    for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
  const int64_t nb = K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* q = qs + b * kBlock;
    const __m256 vd = _mm256_set1_ps(d[b]);
    __m256 w[4];
    for (int j = 0; j < 4; ++j) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j));
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), vd);
    }
    const float* xb = x + b * kBlock;
    for (int r = 0; r < MB; ++r) {
      const float* xr = xb + r * K;
      for (int j = 0; j < 4; ++j)
        acc[r][j % NA] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * j), w[j], acc[r][j % NA]);
    }
  }
  for (int r = 0; r < MB; ++r) {
    __m256 s = acc[r][0];
    for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[r][a]);
    out[r * ldo] = hsum(s);
  }
}
#else  // portable scalar version, same weight values
template <int MB>
inline void q4_1_row(const float* x, int64_t K, const uint8_t* qs, const float* d,
                     const float* m, float* out, int64_t ldo) {
  float acc[MB] = {};
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float w[kBlock];
    for (int i = 0; i < 16; ++i) {
      w[i] = std::fma(float(qs[b * 16 + i] & 0x0F), d[b], m[b]);
      w[i + 16] = std::fma(float(qs[b * 16 + i] >> 4), d[b], m[b]);
    }
    for (int r = 0; r < MB; ++r)
      for (int i = 0; i < kBlock; ++i) acc[r] += x[r * K + b * kBlock + i] * w[i];
  }
  for (int r = 0; r < MB; ++r) out[r * ldo] = acc[r];
}

template <int MB>
inline void q8_0_row(const float* x, int64_t K, const int8_t* qs, const float* d, float* out,
                     int64_t ldo) {
  float acc[MB] = {};
  for (int64_t b = 0; b < K / kBlock; ++b) {
    for (int r = 0; r < MB; ++r)
      for (int i = 0; i < kBlock; ++i)
        acc[r] += x[r * K + b * kBlock + i] * (float(qs[b * kBlock + i]) * d[b]);
  }
  for (int r = 0; r < MB; ++r) out[r * ldo] = acc[r];
}
#endif

// Dispatch a chunk of activation rows (mb <= kMaxMB) to the matching instantiation.
template <typename F>
inline void by_mb(int64_t mb, F&& f) {
  switch (mb) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

void check_common(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && qs.device().is_cpu() && d.device().is_cpu(),
              "cpu_quant: tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "cpu_quant: x must be [M, K] float32");
  TORCH_CHECK(K % kBlock == 0, "cpu_quant: K must be a multiple of 32, got ", K);
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kFloat && d.size(1) == K / kBlock &&
                  d.is_contiguous(),
              "cpu_quant: d must be contiguous float32 [N, K/32]");
  TORCH_CHECK(d.size(0) == qs.size(0), "cpu_quant: qs and d disagree on N");
}

// Rows [0, N) in chunks of ~16 KiB of packed weights, handed out dynamically (an atomic
// counter) to torch's intra-op threads: when one thread is descheduled (a busy machine),
// the others take over its share instead of waiting for a fixed half to finish.
template <typename F>
void parallel_rows(int64_t N, int64_t row_bytes, F&& f) {
  const int64_t chunk = std::max<int64_t>(4, (16 << 10) / std::max<int64_t>(row_bytes, 1));
  const int64_t nchunks = (N + chunk - 1) / chunk;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), nchunks);
  if (nt <= 1 || at::in_parallel_region()) {
    f(0, N);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < nchunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      f(c * chunk, std::min(N, (c + 1) * chunk));
  });
}

}  // namespace

at::Tensor q4_1_gemv(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                     const at::Tensor& m) {
  const int64_t K = x_in.size(-1);
  check_common(x_in, qs, d, K);
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.size(1) == K / 2 &&
                  qs.is_contiguous(),
              "cpu_quant: qs must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == at::kFloat && m.is_contiguous(),
              "cpu_quant: m must be contiguous float32 [N, K/32]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = qs.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t nb = K / kBlock;
  parallel_rows(N, K / 2 + nb * 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t r0 = 0; r0 < M; r0 += kMaxMB) {
        const int64_t mb = std::min<int64_t>(kMaxMB, M - r0);
        by_mb(mb, [&](auto c) {
          q4_1_row<decltype(c)::value>(xp + r0 * K, K, qp + n * (K / 2), dp + n * nb,
                                       mp + n * nb, op + r0 * N + n, N);
        });
      }
    }
  });
  return out;
}

at::Tensor q8_0_gemv(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d) {
  const int64_t K = x_in.size(-1);
  check_common(x_in, qs, d, K);
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.size(1) == K &&
                  qs.is_contiguous(),
              "cpu_quant: qs must be contiguous int8 [N, K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = qs.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t nb = K / kBlock;
  parallel_rows(N, K + nb * 4, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t r0 = 0; r0 < M; r0 += kMaxMB) {
        const int64_t mb = std::min<int64_t>(kMaxMB, M - r0);
        by_mb(mb, [&](auto c) {
          q8_0_row<decltype(c)::value>(xp + r0 * K, K, qp + n * K, dp + n * nb,
                                       op + r0 * N + n, N);
        });
      }
    }
  });
  return out;
}

bool simd_enabled() { return PDS_AVX2; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_1_gemv", &q4_1_gemv, "x [M, K] @ Q4_1 weights [N, K]^T -> [M, N] (fp32)");
  mod.def("q8_0_gemv", &q8_0_gemv, "x [M, K] @ Q8_0 weights [N, K]^T -> [M, N] (fp32)");
  mod.def("simd_enabled", &simd_enabled, "True when built with AVX2 + FMA");
}
