// Causal attention's backward on CPUs with AMX, every product on oneDNN's brgemm.
//
// PyTorch's CPU flash backward runs the recomputed scores (Q K^T) and dP = dO V^T, whose
// outputs are fp32, in ATen's generic gemm: at sequence 1024 its backward takes ~5x its
// forward (docs/benchmarks.md). Here all five products of a block go through
// at::native::cpublas::brgemm, and the elementwise work runs in AVX-512.
//
// A block is kv_block keys x q_block queries, held transposed (keys as rows) so the softmax
// statistics of the queries (logsumexp, rowsum(dO * O)) run along the vectors:
//   S^T = K_n Q_m^T,  dP^T = V_n dO_m^T                      (fp32)
//   P^T = exp(scale S^T - lse_m),  dS^T = scale P^T (dP^T - delta_m), causal entries 0
//   dV_n += P^T dO_m,  dK_n += dS^T Q_m,  dQ_m^T += K_n^T dS^T  (fp32 accumulators)
//
// Inputs as SDPA's flash kernel gives them: q (b, h, t, d), k and v (b, kv, t, d) with h a
// multiple of kv (grouped-query heads), out (b, h, t, d), lse (b, h, t) fp32, all bf16 but lse,
// any strides with a dense last dimension. Outputs dq, dk, dv contiguous bf16. t must be a
// multiple of both block sizes, which must be multiples of 16, and d even.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

using bf16 = at::BFloat16;
namespace blas = at::native::cpublas;

// oneDNN packs B operands at most 64 columns wide: a B operand of K x N lives here as panels
// of K x 64 (the last one narrower), panel j at offset j * 64 * K.
constexpr int64_t PANEL = 64;

// rows x cols of `src` (row stride ld) -> packed panels of the B operand (K = rows, N = cols)
void pack_rows(const bf16* src, int64_t ld, int64_t rows, int64_t cols, bf16* dst) {
  for (int64_t n = 0; n < cols; n += PANEL) {
    const int64_t w = std::min(PANEL, cols - n);
    blas::pack(rows, w, ld, w, at::kBFloat16, at::kBFloat16, src + n, dst + n * rows);
  }
}

// rows x cols of `src` (row stride ld) -> its transpose, dense (cols x rows)
void transpose(const bf16* src, int64_t ld, int64_t rows, int64_t cols, bf16* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * ld + c];
}

// C (M x N, row stride ldc) = or += A (M x K, row stride lda) B, B in packed panels
void gemm(int64_t M, int64_t N, int64_t K, const bf16* A, int64_t lda, const bf16* B, float* C,
          int64_t ldc, bool add) {
  for (int64_t n = 0; n < N; n += PANEL) {
    const int64_t w = std::min(PANEL, N - n);
    blas::brgemm(M, w, K, lda, w, ldc, add, A, B + n * K, C + n);
  }
}

// e^x for x <= ~0 (softmax terms), to ~1e-7 relative: 2^n e^r with |r| <= ln2 / 2
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // below: 0 after scaling
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline void store_bf16(bf16* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}

// One block's elementwise step: s (KB x QB) -> P^T and dS^T in bf16, from dp (KB x QB).
// Key n0 + c sees query m0 + r when n0 + c <= m0 + r.
void softmax_grads(const float* s, const float* dp, const float* lse, const float* delta,
                   int64_t KB, int64_t QB, int64_t n0, int64_t m0, float scale, bf16* pT,
                   bf16* dsT) {
  const __m512 vs = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t c = 0; c < KB; ++c) {
    const int64_t first = n0 + c - m0;  // the first query column that sees this key
    for (int64_t r = 0; r < QB; r += 16) {
      const int64_t i = c * QB + r;
      if (r + 16 <= first) {  // no query here sees the key
        store_bf16(pT + i, _mm512_setzero_ps());
        store_bf16(dsT + i, _mm512_setzero_ps());
        continue;
      }
      __m512 p = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + i), vs, _mm512_loadu_ps(lse + r)));
      __m512 ds = _mm512_mul_ps(
          _mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(dp + i), _mm512_loadu_ps(delta + r))),
          vs);
      if (r < first) {  // part of the vector is before the diagonal
        const __mmask16 seen = _mm512_cmpge_epi32_mask(
            _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(r))),
            _mm512_set1_epi32(static_cast<int>(first)));
        p = _mm512_maskz_mov_ps(seen, p);
        ds = _mm512_maskz_mov_ps(seen, ds);
      }
      store_bf16(pT + i, p);
      store_bf16(dsT + i, ds);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale, int64_t q_block,
    int64_t kv_block) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && dout.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16 && lse.scalar_type() == at::kFloat,
              "attention_backward: bf16 q, k, v, out, dout and fp32 lse");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t KV = k.size(1);
  TORCH_CHECK(k.size(2) == T && v.size(2) == T && H % KV == 0, "attention_backward: shapes");
  TORCH_CHECK(T % q_block == 0 && T % kv_block == 0 && D % 2 == 0 && q_block % 16 == 0 &&
                  kv_block % 16 == 0,
              "attention_backward: t must divide into blocks of a multiple of 16, d be even");
  for (const auto* x : {&dout, &q, &k, &v, &out})
    TORCH_CHECK(x->stride(3) == 1, "attention_backward: the head dimension must be dense");
  const int64_t G = H / KV, QB = q_block, KB = kv_block;
  const float sc = static_cast<float>(scale);

  auto dq = at::empty({B, H, T, D}, q.options());
  auto dk = at::empty({B, KV, T, D}, k.options());
  auto dv = at::empty({B, KV, T, D}, v.options());
  const bf16 *q_p = q.const_data_ptr<bf16>(), *k_p = k.const_data_ptr<bf16>(),
             *v_p = v.const_data_ptr<bf16>(), *o_p = out.const_data_ptr<bf16>(),
             *do_p = dout.const_data_ptr<bf16>();
  const float* lse_p = lse.const_data_ptr<float>();
  bf16 *dq_p = dq.data_ptr<bf16>(), *dk_p = dk.data_ptr<bf16>(), *dv_p = dv.data_ptr<bf16>();

  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    // per head of the group: Q and dO packed as they are (for dK, dV) and transposed (for
    // S^T, dP^T), a query block at a time; logsumexp and rowsum(dO * O); dQ^T's accumulator
    std::vector<bf16> q_pack(G * T * D), qT_pack(G * T * D), do_pack(G * T * D),
        doT_pack(G * T * D), tmp(std::max(QB, KB) * D);
    std::vector<float> lse_h(G * T), delta(G * T), dqT(G * D * T);
    std::vector<bf16> kT(D * KB), pT(KB * QB), dsT(KB * QB), dsT_pack(KB * QB);
    std::vector<float> s(KB * QB), dp(KB * QB), dk_acc(KB * D), dv_acc(KB * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KV, kvh = task % KV;
      auto row = [&](const at::Tensor& x, const bf16* base, int64_t h, int64_t i) {
        return base + b * x.stride(0) + h * x.stride(1) + i * x.stride(2);
      };
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        for (int64_t i = 0; i < T; ++i) {
          const bf16 *o_r = row(out, o_p, h, i), *do_r = row(dout, do_p, h, i);
          float acc = 0.f;
          for (int64_t c = 0; c < D; ++c) acc += float(o_r[c]) * float(do_r[c]);
          delta[g * T + i] = acc;
          lse_h[g * T + i] = lse_p[b * lse.stride(0) + h * lse.stride(1) + i * lse.stride(2)];
        }
        for (int64_t m0 = 0; m0 < T; m0 += QB) {
          const int64_t off = (g * T + m0) * D;
          pack_rows(row(q, q_p, h, m0), q.stride(2), QB, D, &q_pack[off]);
          pack_rows(row(dout, do_p, h, m0), dout.stride(2), QB, D, &do_pack[off]);
          transpose(row(q, q_p, h, m0), q.stride(2), QB, D, tmp.data());
          pack_rows(tmp.data(), QB, D, QB, &qT_pack[off]);
          transpose(row(dout, do_p, h, m0), dout.stride(2), QB, D, tmp.data());
          pack_rows(tmp.data(), QB, D, QB, &doT_pack[off]);
        }
      }
      std::fill(dqT.begin(), dqT.end(), 0.f);
      for (int64_t n0 = 0; n0 < T; n0 += KB) {
        const bf16* k_n = k_p + b * k.stride(0) + kvh * k.stride(1) + n0 * k.stride(2);
        const bf16* v_n = v_p + b * v.stride(0) + kvh * v.stride(1) + n0 * v.stride(2);
        transpose(k_n, k.stride(2), KB, D, kT.data());
        std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
        std::fill(dv_acc.begin(), dv_acc.end(), 0.f);
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t m0 = (n0 / QB) * QB; m0 < T; m0 += QB) {  // queries that see keys n0..
            const int64_t off = (g * T + m0) * D;
            gemm(KB, QB, D, k_n, k.stride(2), &qT_pack[off], s.data(), QB, false);
            gemm(KB, QB, D, v_n, v.stride(2), &doT_pack[off], dp.data(), QB, false);
            softmax_grads(s.data(), dp.data(), &lse_h[g * T + m0], &delta[g * T + m0], KB, QB,
                          n0, m0, sc, pT.data(), dsT.data());
            gemm(KB, D, QB, pT.data(), QB, &do_pack[off], dv_acc.data(), D, true);
            gemm(KB, D, QB, dsT.data(), QB, &q_pack[off], dk_acc.data(), D, true);
            pack_rows(dsT.data(), QB, KB, QB, dsT_pack.data());
            gemm(D, QB, KB, kT.data(), KB, dsT_pack.data(), &dqT[g * D * T + m0], T, true);
          }
        }
        bf16* dk_n = dk_p + ((b * KV + kvh) * T + n0) * D;
        bf16* dv_n = dv_p + ((b * KV + kvh) * T + n0) * D;
        for (int64_t i = 0; i < KB * D; ++i) {
          dk_n[i] = dk_acc[i];
          dv_n[i] = dv_acc[i];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        bf16* dq_h = dq_p + ((b * H + kvh * G + g) * T) * D;
        const float* acc = &dqT[g * D * T];
        for (int64_t i = 0; i < T; ++i)
          for (int64_t c = 0; c < D; ++c) dq_h[i * D + c] = acc[c * T + i];
      }
    }
    blas::brgemm_release();
  });
  return {dq, dk, dv};
}

bool packs_bf16() { return blas::could_pack(at::kBFloat16); }

}  // namespace

TORCH_LIBRARY(zerostack, m) {
  m.def(
      "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float scale, int q_block, int kv_block) -> (Tensor, Tensor, Tensor)");
  m.def("attention_backward_packs() -> bool", &packs_bf16);
}

TORCH_LIBRARY_IMPL(zerostack, CPU, m) { m.impl("attention_backward", &attention_backward); }
