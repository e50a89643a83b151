// Exact causal attention of scattered query rows over one sequence's paged K/V (pybind11 module
// ucm.sparse.blend._attention).
//
// Blend recomputes a few hundred tokens spread over a long prompt; each must attend to every key
// up to its own position. The torch fallback (tiled_attention.py) runs one GEMM per tile of
// queries over a gathered copy of K/V, then four elementwise passes over a score buffer that
// does not fit in cache. Here each (KV head, tile of queries) reads the pages in place, one page
// at a time: scores for the page stay in L1/L2, softmax is online (flash style), and P.V is
// accumulated right away. Two register-blocked micro-kernels do the FLOPs: AVX-512 (16 lanes, 32
// registers) where the CPU has it, else AVX2 + FMA (8 lanes, 16 registers, smaller blocks).
//
// Page formats (vLLM's CPU attention), for every (page, KV head) K then V:
//   kF32, kBF16 (ISA vec/vec16): K transposed [head_dim, page_size], V [page_size, head_dim].
//   kBF16Amx (ISA amx, bfloat16): VNNI tiles. K(t, d) at (t/16)*16*D + (d/2)*32 + (t%16)*2 + d%2,
//     so one 64-byte load holds dims d, d+1 of 16 keys; V(t, d) at page_size*D + (d/16)*16*page_size
//     + (t/2)*32 + (d%16)*2 + t%2, so one load holds 16 dims of keys t, t+1.
// By default bfloat16 is widened to float32 in registers (a 16-bit shift) and all arithmetic is
// float32. On CPUs with AVX512-BF16 a third variant reads bfloat16 pages with bfloat16 dot products
// (vdpbf16ps: two products per float32 lane, so half the instructions of the widening kernels): the
// queries (already bfloat16 in a bfloat16 model; scores are scaled after the dot product) and the
// softmax weights are rounded to bfloat16, as vLLM's AMX kernel rounds them; sums stay float32. In the vec16 layout a key pair (QK: dims d, d+1; P.V: keys j, j+1) is formed
// by interleaving two rows, which permutes lanes within 128-bit blocks: scores are put back in key
// order per block, the output accumulates in that permuted dim order and is put back on write.
// On CPUs with AMX a fourth variant multiplies AMX pages with tiles (namespace amx, below), with
// the dot variant's rounding; it is the default there, and other pages there run widened.
//
// Each variant is compiled via a target attribute and only called where the CPU has it;
// `isas()` lists them (best first), `supports()` says whether any applies, and Python falls back
// to the torch path otherwise.
//
// Threads: the caller's thread works too, plus num_threads - 1 helpers. vLLM's CPU worker binds
// each OpenMP thread to one core, and a thread inherits its creator's binding, so helpers would
// all share the caller's core: Python passes the cores to pin them to (those of the process's
// other threads), or none where the caller is not bound.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define UCM_AVX512 __attribute__((target("avx512f")))
#define UCM_AVX2 __attribute__((target("avx2,fma")))
#define UCM_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define UCM_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
#endif

namespace py = pybind11;

namespace ucm_attn {

enum PageFormat { kF32 = 0, kBF16 = 1, kBF16Amx = 2 };
enum Isa { kBest = 0, kAvx512 = 1, kAvx2 = 2, kAvx512Bf16 = 3, kAmx = 4 };

struct Problem {
  const float* q;        // [n, hk * group, D], contiguous
  const int64_t* pos;    // [n], non-decreasing
  int64_t n;
  const void* pages;     // page p, head h at pages + p * page_stride + h * head_stride
  int64_t page_stride;   // in elements
  int64_t head_stride;   // in elements
  const int64_t* table;  // [num_pages]: the sequence's page ids, in key order
  int64_t num_pages;
  int hk, group, head_dim, page_size;
  float scale;
  float* out;            // [n, hk * group, D]
  int tile_queries;
};

#if defined(__x86_64__)

constexpr int kQkRows = 12;  // S micro-kernel: 12 rows x 32 keys (24 accumulators)
constexpr int kQkKeys = 32;

// exp(x) for 16 lanes: Cephes' expf polynomial on x - n*ln2, scaled by 2^n with vscalefps.
// Relative error about 2e-7; inputs below -103 give exactly 0.
UCM_AVX512 static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 16 floats from 16 consecutive elements of a page.
UCM_AVX512 static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
UCM_AVX512 static inline __m512 load16(const uint16_t* p) {  // bfloat16: the high half of a float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// The even and odd bfloat16 elements of 32 interleaved ones (an AMX VNNI pair), as two float vectors.
UCM_AVX512 static inline void load_pair(const uint16_t* p, __m512& even, __m512& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The first min(n, 16) lanes.
static inline __mmask16 lanes(int n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// The largest of s[0:valid] (valid > 0).
UCM_AVX512 static inline float row_max(const float* s, int valid) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = neg_inf;
  for (int j = 0; j < valid; j += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(neg_inf, lanes(valid - j), s + j));
  return _mm512_reduce_max_ps(mx);
}

// s[r, 0:32] = q[r, :] . K[c0:c0+32, :] for 12 rows, K of one (page, head); ps = page size.
template <int D, int Fmt, typename T>
UCM_AVX512 static inline void qk_12x32(const float* q, const T* kt, int ps, int c0, float* s, int lds) {
  __m512 c[kQkRows][2];
  for (int r = 0; r < kQkRows; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  if constexpr (Fmt == kBF16Amx) {
    const T* tile = kt + static_cast<int64_t>(c0 / 16) * 16 * D;  // keys c0 .. c0+15; the next tile follows
    for (int d = 0; d < D; d += 2) {
      __m512 k0, k0n, k1, k1n;  // dims d (k0, k1) and d + 1 (k0n, k1n) of keys c0.. and c0+16..
      load_pair(tile + d * 16, k0, k0n);
      load_pair(tile + 16 * D + d * 16, k1, k1n);
      for (int r = 0; r < kQkRows; ++r) {
        const __m512 a = _mm512_set1_ps(q[r * D + d]), b = _mm512_set1_ps(q[r * D + d + 1]);
        c[r][0] = _mm512_fmadd_ps(b, k0n, _mm512_fmadd_ps(a, k0, c[r][0]));
        c[r][1] = _mm512_fmadd_ps(b, k1n, _mm512_fmadd_ps(a, k1, c[r][1]));
      }
    }
  } else {
    for (int d = 0; d < D; ++d) {
      const __m512 k0 = load16(kt + d * ps + c0);
      const __m512 k1 = load16(kt + d * ps + c0 + 16);
      for (int r = 0; r < kQkRows; ++r) {
        const __m512 a = _mm512_set1_ps(q[r * D + d]);
        c[r][0] = _mm512_fmadd_ps(a, k0, c[r][0]);
        c[r][1] = _mm512_fmadd_ps(a, k1, c[r][1]);
      }
    }
  }
  for (int r = 0; r < kQkRows; ++r) {
    _mm512_storeu_ps(s + r * lds, c[r][0]);
    _mm512_storeu_ps(s + r * lds + 16, c[r][1]);
  }
}

// o[r, :] += p[r, 0:keys] . V[0:keys, :] for MR rows (MR * D / 16 = 24 accumulators).
template <int D, int MR, int Fmt, typename T>
UCM_AVX512 static inline void pv_block(const float* p, int ldp, const T* v, int ps, int keys, float* o) {
  constexpr int NV = D / 16;
  __m512 c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int x = 0; x < NV; ++x) c[r][x] = _mm512_loadu_ps(o + r * D + 16 * x);
  if constexpr (Fmt == kBF16Amx) {
    for (int j = 0; j < keys; j += 2) {
      const bool two = j + 1 < keys;  // an odd tail: key j alone (p[j + 1] is not a score)
      for (int x = 0; x < NV; ++x) {
        __m512 va, vb;  // dims 16x.. of keys j and j + 1
        load_pair(v + static_cast<int64_t>(x) * 16 * ps + j * 16, va, vb);
        for (int r = 0; r < MR; ++r) {
          c[r][x] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * ldp + j]), va, c[r][x]);
          if (two) c[r][x] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * ldp + j + 1]), vb, c[r][x]);
        }
      }
    }
  } else {
    for (int j = 0; j < keys; ++j) {
      __m512 vv[NV];
      for (int x = 0; x < NV; ++x) vv[x] = load16(v + j * D + 16 * x);
      for (int r = 0; r < MR; ++r) {
        const __m512 a = _mm512_set1_ps(p[r * ldp + j]);
        for (int x = 0; x < NV; ++x) c[r][x] = _mm512_fmadd_ps(a, vv[x], c[r][x]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int x = 0; x < NV; ++x) _mm512_storeu_ps(o + r * D + 16 * x, c[r][x]);
}

// ---- AVX512-BF16: bfloat16 pages with bfloat16 dot products --------------------------------
namespace dot {

constexpr int kPvRows = 6;  // P.V rows per block, over 64 dims at a time (24 accumulators)

// Round-to-nearest-even float32 -> bfloat16 bits (NaN stays NaN).
static inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Where an interleaved pair vector's lanes land: unpacklo/unpackhi of two rows of 32 elements give,
// in each 128-bit block b, elements 8b..8b+3 (lo) and 8b+4..8b+7 (hi). `slot(i)` is the lane
// (0..31 over lo then hi) that holds element i of the 32.
static constexpr int slot(int i) { return (i % 8 < 4 ? 0 : 16) + 4 * (i / 8) + i % 4; }

// q pairs: qp[r * D / 2 + i] holds bfloat16 q[r, 2i] (low half) and q[r, 2i + 1] (high half).
static inline void pack_queries(const float* q, int rows, int D, std::vector<uint32_t>& qp) {
  qp.resize(static_cast<size_t>(rows) * D / 2);
  for (int i = 0; i < rows * D / 2; ++i)
    qp[i] = bf16_bits(q[2 * i]) | static_cast<uint32_t>(bf16_bits(q[2 * i + 1])) << 16;
}

UCM_AVX512BF16 static inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }
UCM_AVX512BF16 static inline __m512bh bcast_pair(const void* p) {
  uint32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
}

// s[r, 0:32] = scale * q[r, :] . K[c0:c0+32, :] for 12 rows (bfloat16 q pairs `qp`), K of one (page, head).
template <int D, int Fmt>
UCM_AVX512BF16 static void qk_12x32(const uint32_t* qp, const uint16_t* kt, int ps, int c0, float scale, float* s,
                                    int lds) {
  __m512 c[kQkRows][2];
  for (int r = 0; r < kQkRows; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 2) {
    __m512bh k0, k1;
    if constexpr (Fmt == kBF16Amx) {  // already pairs of dims d, d + 1: keys c0.. and c0 + 16..
      const uint16_t* tile = kt + static_cast<int64_t>(c0 / 16) * 16 * D;
      k0 = as_bh(_mm512_loadu_si512(tile + d * 16));
      k1 = as_bh(_mm512_loadu_si512(tile + 16 * D + d * 16));
    } else {  // rows d and d + 1 of K^T, interleaved: keys in slot() order
      const __m512i a = _mm512_loadu_si512(kt + d * ps + c0), b = _mm512_loadu_si512(kt + (d + 1) * ps + c0);
      k0 = as_bh(_mm512_unpacklo_epi16(a, b));
      k1 = as_bh(_mm512_unpackhi_epi16(a, b));
    }
    for (int r = 0; r < kQkRows; ++r) {
      const __m512bh a = bcast_pair(qp + r * D / 2 + d / 2);
      c[r][0] = _mm512_dpbf16_ps(c[r][0], a, k0);
      c[r][1] = _mm512_dpbf16_ps(c[r][1], a, k1);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  if constexpr (Fmt == kBF16Amx) {
    for (int r = 0; r < kQkRows; ++r) {
      _mm512_storeu_ps(s + r * lds, _mm512_mul_ps(c[r][0], sc));
      _mm512_storeu_ps(s + r * lds + 16, _mm512_mul_ps(c[r][1], sc));
    }
  } else {
    alignas(64) static constexpr int order[32] = {
        slot(0), slot(1), slot(2), slot(3), slot(4), slot(5), slot(6), slot(7), slot(8), slot(9), slot(10),
        slot(11), slot(12), slot(13), slot(14), slot(15), slot(16), slot(17), slot(18), slot(19), slot(20),
        slot(21), slot(22), slot(23), slot(24), slot(25), slot(26), slot(27), slot(28), slot(29), slot(30), slot(31)};
    const __m512i first = _mm512_load_si512(order), second = _mm512_load_si512(order + 16);
    for (int r = 0; r < kQkRows; ++r) {
      _mm512_storeu_ps(s + r * lds, _mm512_mul_ps(_mm512_permutex2var_ps(c[r][0], first, c[r][1]), sc));
      _mm512_storeu_ps(s + r * lds + 16, _mm512_mul_ps(_mm512_permutex2var_ps(c[r][0], second, c[r][1]), sc));
    }
  }
}

// o[r, 64h:64h+64] += p[r, 0:keys] . V[0:keys, 64h:64h+64] for kPvRows rows and every h; p in
// bfloat16 with p[r, keys] == 0 when keys is odd. vec16 pages: o's dims in slot() order per 32.
template <int D, int Fmt>
UCM_AVX512BF16 static void pv_block(const uint16_t* p, int ldp, const uint16_t* v, int ps, int keys, float* o) {
  for (int h = 0; h < D / 64; ++h) {
    __m512 c[kPvRows][4];
    for (int r = 0; r < kPvRows; ++r)
      for (int x = 0; x < 4; ++x) c[r][x] = _mm512_loadu_ps(o + r * D + 64 * h + 16 * x);
    for (int j = 0; j < keys; j += 2) {
      const bool two = j + 1 < keys;  // an odd tail: the pair's second key is not there (may be NaN)
      __m512bh vv[4];
      if constexpr (Fmt == kBF16Amx) {  // keys j, j + 1 of 16 dims per load
        for (int x = 0; x < 4; ++x) {
          __m512i pair = _mm512_loadu_si512(v + static_cast<int64_t>(4 * h + x) * 16 * ps + j * 16);
          if (!two) pair = _mm512_maskz_mov_epi16(0x55555555u, pair);
          vv[x] = as_bh(pair);
        }
      } else {  // rows j and j + 1 of V, interleaved: dims in slot() order per 32
        for (int y = 0; y < 2; ++y) {
          const __m512i a = _mm512_loadu_si512(v + j * D + 64 * h + 32 * y);
          const __m512i b = two ? _mm512_loadu_si512(v + (j + 1) * D + 64 * h + 32 * y) : _mm512_setzero_si512();
          vv[2 * y] = as_bh(_mm512_unpacklo_epi16(a, b));
          vv[2 * y + 1] = as_bh(_mm512_unpackhi_epi16(a, b));
        }
      }
      for (int r = 0; r < kPvRows; ++r) {
        const __m512bh a = bcast_pair(p + r * ldp + j);
        for (int x = 0; x < 4; ++x) c[r][x] = _mm512_dpbf16_ps(c[r][x], a, vv[x]);
      }
    }
    for (int r = 0; r < kPvRows; ++r)
      for (int x = 0; x < 4; ++x) _mm512_storeu_ps(o + r * D + 64 * h + 16 * x, c[r][x]);
  }
}

// p16[r, 0:kpad] = bfloat16 of s[r, 0:kend], zero past kend, for rows [r0, r1); kpad: a multiple
// of 16 at or past kend.
UCM_AVX512BF16 static void round_rows(const float* s, int lds, uint16_t* p16, int ldp, int r0, int r1, int kend,
                                      int kpad) {
  for (int r = r0; r < r1; ++r)
    for (int j = 0; j < kpad; j += 16) {
      const int lim = std::clamp(kend - j, 0, 16);
      const __m512 x = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << lim) - 1), s + r * lds + j);
      const __m256bh y = _mm512_cvtneps_pbh(x);
      std::memcpy(p16 + r * ldp + j, &y, sizeof(y));
    }
}

}  // namespace dot

struct Scratch {
  std::vector<float> q, s, o, m, l;
  std::vector<int64_t> pos;
  std::vector<uint32_t> qp;  // the dot variant's bfloat16 query pairs
  std::vector<uint16_t> p;   // and its bfloat16 softmax weights
  std::vector<uint16_t> qb;  // the AMX variant's bfloat16 queries, row-major
  std::vector<uint16_t> vt;  // and V's last pairs of keys of a page, past the keys seen zeroed
};

// Sizes the scratch for R rows (query, head in group) of KV head h and copies the queries
// [t0, t0 + rows / group) in, times `scale`; padding rows up to R repeat the last row (their output
// is dropped).
template <int D>
static void fill_queries(const Problem& pb, int h, int64_t t0, int rows, int R, int lds, float scale, Scratch& w) {
  const int g = pb.group, hq = pb.hk * g;
  w.q.assign(static_cast<size_t>(R) * D, 0.0f);
  w.o.assign(static_cast<size_t>(R) * D, 0.0f);
  w.s.resize(static_cast<size_t>(R) * lds);
  w.m.assign(R, -std::numeric_limits<float>::infinity());
  w.l.assign(R, 0.0f);
  w.pos.resize(R);
  for (int r = 0; r < R; ++r) {
    const int rr = std::min(r, rows - 1);
    const int64_t t = t0 + rr / g;
    const int head = h * g + rr % g;
    w.pos[r] = pb.pos[t];
    const float* src = pb.q + (t * hq + head) * D;
    for (int d = 0; d < D; ++d) w.q[r * D + d] = src[d] * scale;
  }
}

// The normalised output rows of KV head h, queries [t0, t0 + rows / group); `permuted`: the rows'
// dims are in dot::slot() order per 32 (the dot variant on vec16 pages).
template <int D>
static void write_out(const Problem& pb, int h, int64_t t0, int rows, const Scratch& w, bool permuted = false) {
  const int g = pb.group, hq = pb.hk * g;
  for (int r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / g;
    const int head = h * g + r % g;
    float* dst = pb.out + (t * hq + head) * D;
    const float inv = 1.0f / w.l[r];
    const float* o = w.o.data() + r * D;
    if (permuted)
      for (int d = 0; d < D; ++d) dst[d] = o[d / 32 * 32 + dot::slot(d % 32)] * inv;
    else
      for (int d = 0; d < D; ++d) dst[d] = o[d] * inv;
  }
}

// The queries of `fill_queries` for the AVX-512 drivers; `Dot` (the dot variant) leaves them
// unscaled, so a bfloat16 model's queries round to bfloat16 exactly (its kernels scale the scores),
// and packs them in bfloat16 pairs.
template <int D, bool Dot>
static void load_queries(const Problem& pb, int h, int64_t t0, int rows, int R, int lds, Scratch& w) {
  fill_queries<D>(pb, h, t0, rows, R, lds, Dot ? 1.0f : pb.scale, w);
  if constexpr (Dot) dot::pack_queries(w.q.data(), R, D, w.qp);
}

// Scores of rows [r_from, R) over the keys [0, kpad) of one (page, head) `kt` into w.s (row stride
// page_size).
template <int D, int Fmt, typename T, bool Dot>
UCM_AVX512 static void page_scores(const Problem& pb, const T* kt, int kpad, int r_from, int R, Scratch& w) {
  const int ps = pb.page_size;
  for (int c0 = 0; c0 < kpad; c0 += kQkKeys)
    for (int r0 = r_from; r0 < R; r0 += kQkRows)
      if constexpr (Dot)
        dot::qk_12x32<D, Fmt>(w.qp.data() + r0 * D / 2, kt, ps, c0, pb.scale, w.s.data() + r0 * ps + c0, ps);
      else
        qk_12x32<D, Fmt>(w.q.data() + r0 * D, kt, ps, c0, w.s.data() + r0 * ps + c0, ps);
}

// Round-to-nearest-even float32 -> bfloat16 of 16 finite lanes (AVX-512F integer ops).
UCM_AVX512 static inline __m256i bf16_round(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
}

// The online softmax over one page's scores w.s (keys [base, base + kend)) for rows [r_from, R):
// each row's visible scores become their exp against the running max, the rest 0; the running max
// and denominator advance and the rows' outputs are rescaled. `ToBf16` (the AMX variant): the
// scores are not yet scaled (by pb.scale, `scale`), and the exps go to w.p in bfloat16 (row stride
// lds), zero from kend up to `kpad`, instead of replacing the scores.
template <int D, bool ToBf16 = false>
UCM_AVX512 static void softmax_page(Scratch& w, int r_from, int R, int lds, int64_t base, int kend,
                                    float scale = 1.0f, int kpad = 0) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = r_from; r < R; ++r) {
    float* srow = w.s.data() + r * lds;
    uint16_t* prow = ToBf16 ? w.p.data() + r * lds : nullptr;
    const int valid = static_cast<int>(std::clamp<int64_t>(w.pos[r] + 1 - base, 0, kend));
    if (valid == 0) {
      if constexpr (ToBf16)
        std::memset(prow, 0, sizeof(uint16_t) * kpad);
      else
        std::memset(srow, 0, sizeof(float) * kend);
      continue;
    }
    // Scaling by a positive number keeps the largest score the largest (rounding is monotonic).
    const float m_new = std::max(w.m[r], ToBf16 ? row_max(srow, valid) * scale : row_max(srow, valid));
    const float alpha = std::exp(w.m[r] - m_new);  // 0 on the first page seen (m = -inf)
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < (ToBf16 ? kpad : kend); j += 16) {
      const int lim = std::clamp(kend - j, 0, 16);
      const int vis = std::clamp(valid - j, 0, lim);
      const __mmask16 kv = static_cast<__mmask16>((1u << vis) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << lim) - 1), srow + j);
      const __m512 e = _mm512_maskz_mov_ps(
          kv, exp16(ToBf16 ? _mm512_fmsub_ps(x, sc, mv) : _mm512_sub_ps(x, mv)));
      sum = _mm512_add_ps(sum, e);
      if constexpr (ToBf16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), bf16_round(e));
      else
        _mm512_mask_storeu_ps(srow + j, static_cast<__mmask16>((1u << lim) - 1), e);
    }
    w.l[r] = w.l[r] * alpha + _mm512_reduce_add_ps(sum);
    w.m[r] = m_new;
    if (alpha != 1.0f) {
      float* orow = w.o.data() + r * D;
      const __m512 av = _mm512_set1_ps(alpha);
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), av));
    }
  }
}

// One KV head, queries [t0, t1): rows are (query, head in group), padded to a multiple of 12.
// `Dot`: bfloat16 pages through the dot variant's micro-kernels (called, not inlined: they need
// AVX512-BF16, this driver only AVX-512F).
template <int D, int Fmt, typename T, bool Dot = false>
UCM_AVX512 static void run_tile(const Problem& pb, int h, int64_t t0, int64_t t1, Scratch& w) {
  constexpr int MR = 24 / (D / 16);  // P.V rows per block: 6 for D=64, 3 for D=128
  const int g = pb.group, ps = pb.page_size;
  const int rows = static_cast<int>(t1 - t0) * g;
  const int R = (rows + kQkRows - 1) / kQkRows * kQkRows;
  const int lds = ps;
  load_queries<D, Dot>(pb, h, t0, rows, R, lds, w);
  if constexpr (Dot) w.p.resize(static_cast<size_t>(R) * lds);
  const int64_t first = pb.pos[t0], last = pb.pos[t1 - 1];
  const int64_t npages = last / ps + 1;
  if (npages > pb.num_pages) throw std::out_of_range("page table shorter than the query positions");
  for (int64_t p = 0; p < npages; ++p) {
    const T* kt = static_cast<const T*>(pb.pages) + pb.table[p] * pb.page_stride + h * pb.head_stride;
    const T* v = kt + static_cast<int64_t>(D) * ps;
    const int64_t base = p * ps;
    const int kend = static_cast<int>(std::min<int64_t>(ps, last + 1 - base));  // keys any row sees
    const int kpad = (kend + kQkKeys - 1) / kQkKeys * kQkKeys;
    // Rows sorted by position: rows before `r_live` see none of this page.
    int r_live = 0;
    if (base > first)
      while (r_live < R && w.pos[r_live] < base) ++r_live;
    r_live = r_live / kQkRows * kQkRows;
    page_scores<D, Fmt, T, Dot>(pb, kt, kpad, r_live, R, w);
    softmax_page<D>(w, r_live, R, lds, base, kend);
    if constexpr (Dot) {
      dot::round_rows(w.s.data(), lds, w.p.data(), lds, r_live, R, kend, (kend + 15) / 16 * 16);
      for (int r0 = r_live; r0 < R; r0 += dot::kPvRows)
        dot::pv_block<D, Fmt>(w.p.data() + r0 * lds, lds, v, ps, kend, w.o.data() + r0 * D);
    } else {
      for (int r0 = r_live; r0 < R; r0 += MR)
        pv_block<D, MR, Fmt>(w.s.data() + r0 * lds, lds, v, ps, kend, w.o.data() + r0 * D);
    }
  }
  write_out<D>(pb, h, t0, rows, w, Dot && Fmt == kBF16);
}

// ---- AMX: bfloat16 AMX pages through tile matrix multiplies ---------------------------------
// vLLM packs bfloat16 pages for AMX as the B operand of TDPBF16PS wants them: a K tile of 16 keys
// holds dims (d, d + 1) pairs per 64-byte row, a V tile 16 dims of keys (t, t + 1) pairs. So Q.K
// is A = 16 query rows x 32 dims, B = one such K tile, C = 16 x 16 scores; P.V is A = 16 rows x 32
// softmax weights, B = a V tile, C = 16 rows x 16 output dims. Queries and weights are rounded to
// bfloat16 as in the dot variant; the online softmax is the AVX-512 one. V slots past the keys
// any row sees are not read into a product (unwritten slots may hold NaN, and 0 * NaN is NaN).
namespace amx {

constexpr int kRows = 16;  // rows of every tile

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: tiles 0-3 accumulate (C), 4 holds A, 5-7 hold B.
UCM_AMX static void configure() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = kRows;
  }
  _tile_loadconfig(&c);
}

// s[r, 0:kpad] = q[r, :] . K[0:kpad, :] for rows [r_from, R) (both multiples of 16; kpad too),
// q bfloat16 row-major [R, D], K of one (page, head) in AMX tiles. Not scaled.
template <int D>
UCM_AMX static void page_scores(const uint16_t* q, const uint16_t* kt, int kpad, int r_from, int R, float* s,
                                int lds) {
  for (int r0 = r_from; r0 < R; r0 += kRows)
    for (int c0 = 0; c0 < kpad; c0 += 4 * 16) {
      const int nb = std::min(4, (kpad - c0) / 16);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* k = kt + static_cast<int64_t>(c0 / 16) * 16 * D;  // 16 keys: D / 2 rows of pairs
      for (int dc = 0; dc < D / 32; ++dc) {
        _tile_loadd(4, q + r0 * D + dc * 32, D * 2);
        const uint16_t* b = k + dc * 16 * 32;
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nb > 1) {
          _tile_loadd(6, b + 16 * D, 64);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (nb > 2) {
          _tile_loadd(7, b + 32 * D, 64);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (nb > 3) {
          _tile_loadd(5, b + 48 * D, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      float* out = s + r0 * lds + c0;
      _tile_stored(0, out, lds * 4);
      if (nb > 1) _tile_stored(1, out + 16, lds * 4);
      if (nb > 2) _tile_stored(2, out + 32, lds * 4);
      if (nb > 3) _tile_stored(3, out + 48, lds * 4);
    }
}

// o[r, :] += p[r, 0:kend] . V[0:kend, :] for rows [r_from, R), p bfloat16 [R, ldp] zero from kend
// to the next multiple of 32, V of one (page, head) in AMX tiles. `vt`: scratch for the last 32
// keys when kend is not a multiple of 32.
template <int D>
UCM_AMX static void page_values(const uint16_t* p, int ldp, const uint16_t* v, int ps, int kend, int r_from, int R,
                                float* o, std::vector<uint16_t>& vt) {
  const int kfull = kend / 32 * 32;
  const bool tail = kend > kfull;
  if (tail) {  // keys kfull .. kend of every 16 dims, the pairs' keys past kend zero
    vt.assign(static_cast<size_t>(D / 16) * 16 * 32, 0);
    for (int dg = 0; dg < D / 16; ++dg)
      for (int t = kfull; t < kend; ++t)
        for (int n = 0; n < 16; ++n) {
          const int k = (t - kfull) / 2, e = (t - kfull) % 2;
          vt[dg * 512 + k * 32 + n * 2 + e] = v[static_cast<int64_t>(dg) * 16 * ps + (t / 2) * 32 + n * 2 + e];
        }
  }
  for (int r0 = r_from; r0 < R; r0 += kRows)
    for (int dg0 = 0; dg0 < D / 16; dg0 += 4) {  // 4 tiles of 16 output dims at a time
      float* c = o + r0 * D + dg0 * 16;
      _tile_loadd(0, c, D * 4);
      _tile_loadd(1, c + 16, D * 4);
      _tile_loadd(2, c + 32, D * 4);
      _tile_loadd(3, c + 48, D * 4);
      const uint16_t* vd = v + static_cast<int64_t>(dg0) * 16 * ps;
      for (int kc = 0; kc < kfull + (tail ? 32 : 0); kc += 32) {
        _tile_loadd(4, p + r0 * ldp + kc, ldp * 2);
        const bool last = kc == kfull;
        const uint16_t* b = last ? vt.data() + dg0 * 512 : vd + (kc / 2) * 32;
        const int64_t step = last ? 512 : 16 * ps;  // from one 16 dims to the next
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + step, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b + 2 * step, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 3 * step, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, c, D * 4);
      _tile_stored(1, c + 16, D * 4);
      _tile_stored(2, c + 32, D * 4);
      _tile_stored(3, c + 48, D * 4);
    }
}

// One KV head, queries [t0, t1) over AMX pages: rows (query, head in group) padded to a multiple of 16.
template <int D>
UCM_AMX static void run_tile(const Problem& pb, int h, int64_t t0, int64_t t1, Scratch& w) {
  const int g = pb.group, ps = pb.page_size;
  const int rows = static_cast<int>(t1 - t0) * g;
  const int R = (rows + kRows - 1) / kRows * kRows;
  const int lds = ps;
  fill_queries<D>(pb, h, t0, rows, R, lds, 1.0f, w);  // unscaled, as the dot variant: exact for bfloat16 queries
  w.qb.resize(static_cast<size_t>(R) * D);
  for (size_t i = 0; i < w.qb.size(); ++i) w.qb[i] = dot::bf16_bits(w.q[i]);
  w.p.resize(static_cast<size_t>(R) * lds);
  const int64_t first = pb.pos[t0], last = pb.pos[t1 - 1];
  const int64_t npages = last / ps + 1;
  if (npages > pb.num_pages) throw std::out_of_range("page table shorter than the query positions");
  configure();
  for (int64_t p = 0; p < npages; ++p) {
    const uint16_t* kt = static_cast<const uint16_t*>(pb.pages) + pb.table[p] * pb.page_stride + h * pb.head_stride;
    const uint16_t* v = kt + static_cast<int64_t>(D) * ps;
    const int64_t base = p * ps;
    const int kend = static_cast<int>(std::min<int64_t>(ps, last + 1 - base));  // keys any row sees
    int r_live = 0;  // rows before it see none of this page
    if (base > first)
      while (r_live < R && w.pos[r_live] < base) ++r_live;
    r_live = r_live / kRows * kRows;
    page_scores<D>(w.qb.data(), kt, (kend + 15) / 16 * 16, r_live, R, w.s.data(), lds);
    softmax_page<D, true>(w, r_live, R, lds, base, kend, pb.scale, (kend + 31) / 32 * 32);
    page_values<D>(w.p.data(), lds, v, ps, kend, r_live, R, w.o.data(), w.vt);
  }
  _tile_release();
  write_out<D>(pb, h, t0, rows, w);
}

}  // namespace amx


// ---- The probe's attention mass: what each key receives from a few query rows ---------------
// Blend's query rule ranks the loaded tokens by the attention the question's last rows pay them
// (ucm/sparse/blend/query_probe.py attention_mass): per key, the softmax probability summed over
// rows and heads, each head's weighted by the key's V norm there. Read from the pages in place in
// two passes over them (each row's max and denominator, then the probabilities), instead of
// gathering the request's whole K and V per layer. AVX-512 variants only.

constexpr int kMassPages = 8;  // pages per work item

// Scores of every row over page p's keys into w.s (K of KV head h); returns the keys any row sees.
template <int D, int Fmt, typename T, bool Dot>
static int mass_page_scores(const Problem& pb, int h, int64_t p, int R, Scratch& w) {
  const int ps = pb.page_size;
  const T* kt = static_cast<const T*>(pb.pages) + pb.table[p] * pb.page_stride + h * pb.head_stride;
  const int kend = static_cast<int>(std::min<int64_t>(ps, pb.pos[pb.n - 1] + 1 - p * ps));
  page_scores<D, Fmt, T, Dot>(pb, kt, (kend + kQkKeys - 1) / kQkKeys * kQkKeys, 0, R, w);
  return kend;
}

// The rows of KV head h (every query, every head of its group), padded to a multiple of 12.
template <int D, bool Dot>
static int mass_rows(const Problem& pb, int h, Scratch& w) {
  const int rows = static_cast<int>(pb.n) * pb.group;
  const int R = (rows + kQkRows - 1) / kQkRows * kQkRows;
  load_queries<D, Dot>(pb, h, 0, rows, R, pb.page_size, w);
  return R;
}

// The norm of each of a page's first `kend` V rows (KV head h) into `out`.
template <int D, int Fmt, typename T>
UCM_AVX512 static void v_norms(const T* v, int ps, int kend, float* out) {
  if constexpr (Fmt == kBF16Amx) {
    for (int j = 0; j < kend; j += 2) {
      __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
      for (int x = 0; x < D / 16; ++x) {
        __m512 va, vb;  // dims 16x.. of keys j and j + 1
        load_pair(v + static_cast<int64_t>(x) * 16 * ps + j * 16, va, vb);
        a = _mm512_fmadd_ps(va, va, a);
        b = _mm512_fmadd_ps(vb, vb, b);
      }
      out[j] = std::sqrt(_mm512_reduce_add_ps(a));
      if (j + 1 < kend) out[j + 1] = std::sqrt(_mm512_reduce_add_ps(b));
    }
  } else {
    for (int j = 0; j < kend; ++j) {
      __m512 a = _mm512_setzero_ps();
      for (int x = 0; x < D / 16; ++x) {
        const __m512 y = load16(v + j * D + 16 * x);
        a = _mm512_fmadd_ps(y, y, a);
      }
      out[j] = std::sqrt(_mm512_reduce_add_ps(a));
    }
  }
}

// Folds scores s[0:valid] into a row's running max `m` and sum of exp(s - m) `l`.
UCM_AVX512 static void fold_row(const float* s, int valid, float& m, float& l) {
  if (valid <= 0) return;
  const float m_new = std::max(m, row_max(s, valid));
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < valid; j += 16) {
    const __mmask16 k = lanes(valid - j);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv))));
  }
  l = l * std::exp(m - m_new) + _mm512_reduce_add_ps(sum);  // exp(-inf) = 0 on the first keys seen
  m = m_new;
}

// col[0:valid] += exp(s[0:valid] - m) * inv.
UCM_AVX512 static void add_probs(const float* s, int valid, float m, float inv, float* col) {
  const __m512 mv = _mm512_set1_ps(m), iv = _mm512_set1_ps(inv);
  for (int j = 0; j < valid; j += 16) {
    const __mmask16 k = lanes(valid - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv));
    _mm512_mask_storeu_ps(col + j, k, _mm512_fmadd_ps(e, iv, _mm512_maskz_loadu_ps(k, col + j)));
  }
}

// mass[h, key] for every KV head h and key 0 .. pos[n - 1]: sum over the rows of head h's group
// of softmax(scale q.K)[key] (each row over keys 0 .. its position), times |V[key, h]| if
// `weigh`. `mass` is [hk, pos[n - 1] + 1].
template <int D, int Fmt, typename T, bool Dot>
static void run_mass(const Problem& pb, bool weigh, float* mass, int num_threads,
                     const std::vector<int>& helper_cpus) {
  const int ps = pb.page_size, rows = static_cast<int>(pb.n) * pb.group;
  const int64_t num_keys = pb.pos[pb.n - 1] + 1;
  const int64_t npages = (num_keys + ps - 1) / ps;
  if (npages > pb.num_pages) throw std::out_of_range("page table shorter than the query positions");
  const int64_t segs = (npages + kMassPages - 1) / kMassPages;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Pass 1: per (head, segment, row) the max score and the sum of exp(score - max) over its keys.
  std::vector<float> seg_m(static_cast<size_t>(pb.hk * segs * rows), neg_inf);
  std::vector<float> seg_l(seg_m.size(), 0.0f);
  parallel_items(pb.hk * segs, num_threads, helper_cpus, [&](int64_t i, Scratch& w) {
    const int h = static_cast<int>(i / segs);
    const int64_t seg = i % segs;
    const int R = mass_rows<D, Dot>(pb, h, w);
    w.s.resize(static_cast<size_t>(R) * ps);
    float* m = seg_m.data() + i * rows;
    float* l = seg_l.data() + i * rows;
    for (int64_t p = seg * kMassPages; p < std::min(npages, (seg + 1) * kMassPages); ++p) {
      const int kend = mass_page_scores<D, Fmt, T, Dot>(pb, h, p, R, w);
      for (int r = 0; r < rows; ++r) {
        const int valid = static_cast<int>(std::clamp<int64_t>(w.pos[r] + 1 - p * ps, 0, kend));
        fold_row(w.s.data() + r * ps, valid, m[r], l[r]);
      }
    }
  });
  // Each row's max and 1 / denominator over all its keys.
  std::vector<float> row_m(static_cast<size_t>(pb.hk * rows), neg_inf), row_inv(row_m.size(), 0.0f);
  for (int h = 0; h < pb.hk; ++h)
    for (int r = 0; r < rows; ++r) {
      float mx = neg_inf, l = 0.0f;
      for (int64_t seg = 0; seg < segs; ++seg) mx = std::max(mx, seg_m[(h * segs + seg) * rows + r]);
      for (int64_t seg = 0; seg < segs; ++seg) {
        const size_t at = (h * segs + seg) * rows + r;
        if (seg_l[at] > 0.0f) l += seg_l[at] * std::exp(seg_m[at] - mx);
      }
      row_m[h * rows + r] = mx;
      row_inv[h * rows + r] = l > 0.0f ? 1.0f / l : 0.0f;
    }
  // Pass 2: the probabilities, summed over the rows, per key.
  parallel_items(pb.hk * segs, num_threads, helper_cpus, [&](int64_t i, Scratch& w) {
    const int h = static_cast<int>(i / segs);
    const int64_t seg = i % segs;
    const int R = mass_rows<D, Dot>(pb, h, w);
    w.s.resize(static_cast<size_t>(R) * ps);
    w.o.assign(2 * static_cast<size_t>(ps), 0.0f);  // column sums, then V norms
    for (int64_t p = seg * kMassPages; p < std::min(npages, (seg + 1) * kMassPages); ++p) {
      const int kend = mass_page_scores<D, Fmt, T, Dot>(pb, h, p, R, w);
      float* col = w.o.data();
      std::fill(col, col + kend, 0.0f);
      for (int r = 0; r < rows; ++r) {
        const int valid = static_cast<int>(std::clamp<int64_t>(w.pos[r] + 1 - p * ps, 0, kend));
        add_probs(w.s.data() + r * ps, valid, row_m[h * rows + r], row_inv[h * rows + r], col);
      }
      float* out = mass + h * num_keys + p * ps;
      if (weigh) {
        const T* v = static_cast<const T*>(pb.pages) + pb.table[p] * pb.page_stride + h * pb.head_stride +
                     static_cast<int64_t>(D) * ps;
        float* norm = w.o.data() + ps;
        v_norms<D, Fmt, T>(v, ps, kend, norm);
        for (int j = 0; j < kend; ++j) out[j] = col[j] * norm[j];
      } else {
        std::copy(col, col + kend, out);
      }
    }
  });
}

// ---- AVX2 + FMA: the same algorithm with 8 lanes and 16 registers ---------------------------
// It mirrors the AVX-512 kernels above function by function (other intrinsics, smaller register
// blocks, lane masks built by compares). A shared template over a vector type would rewrite the
// AVX-512 path, which AVX2-only hosts cannot run; the unit tests run every variant a host has
// against the same dense reference.
namespace avx2 {

constexpr int kRows = 4;   // S micro-kernel: 4 rows x 16 keys (8 accumulators)
constexpr int kKeys = 16;  // a multiple of 16: an AMX K tile is never split
constexpr int kPvRows = 2;  // P.V micro-kernel: 2 rows x 32 dims (8 accumulators)

// exp(x) for 8 lanes: exp16's polynomial, scaled by 2^n built in the exponent bits, so n stays
// within the normal range (inputs clamped at ln(FLT_MIN)); inputs below that give exactly 0.
UCM_AVX2 static inline __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

UCM_AVX2 static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
UCM_AVX2 static inline __m256 load8(const uint16_t* p) {  // bfloat16: the high half of a float32
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// The even and odd bfloat16 elements of 16 interleaved ones (8 AMX VNNI pairs), as two float vectors.
UCM_AVX2 static inline void load_pair(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// All ones in the first `k` lanes (0 <= k <= 8).
UCM_AVX2 static inline __m256 first_lanes(int k) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
UCM_AVX2 static inline float reduce_max(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
UCM_AVX2 static inline float reduce_add(__m256 x) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

// s[r, 0:16] = q[r, :] . K[c0:c0+16, :] for 4 rows, K of one (page, head); ps = page size.
template <int D, int Fmt, typename T>
UCM_AVX2 static inline void qk_4x16(const float* q, const T* kt, int ps, int c0, float* s, int lds) {
  __m256 c[kRows][2];
  for (int r = 0; r < kRows; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
  if constexpr (Fmt == kBF16Amx) {
    const T* tile = kt + static_cast<int64_t>(c0 / 16) * 16 * D;  // keys c0 .. c0+15
    for (int d = 0; d < D; d += 2) {
      __m256 k0, k0n, k1, k1n;  // dims d (k0, k1) and d + 1 (k0n, k1n) of keys c0.. and c0+8..
      load_pair(tile + d * 16, k0, k0n);
      load_pair(tile + d * 16 + 16, k1, k1n);
      for (int r = 0; r < kRows; ++r) {
        const __m256 a = _mm256_set1_ps(q[r * D + d]), b = _mm256_set1_ps(q[r * D + d + 1]);
        c[r][0] = _mm256_fmadd_ps(b, k0n, _mm256_fmadd_ps(a, k0, c[r][0]));
        c[r][1] = _mm256_fmadd_ps(b, k1n, _mm256_fmadd_ps(a, k1, c[r][1]));
      }
    }
  } else {
    for (int d = 0; d < D; ++d) {
      const __m256 k0 = load8(kt + d * ps + c0);
      const __m256 k1 = load8(kt + d * ps + c0 + 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 a = _mm256_set1_ps(q[r * D + d]);
        c[r][0] = _mm256_fmadd_ps(a, k0, c[r][0]);
        c[r][1] = _mm256_fmadd_ps(a, k1, c[r][1]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(s + r * lds, c[r][0]);
    _mm256_storeu_ps(s + r * lds + 8, c[r][1]);
  }
}

// o[r, 32x:32x+32] += p[r, 0:keys] . V[0:keys, 32x:32x+32] for 2 rows, every x.
template <int D, int Fmt, typename T>
UCM_AVX2 static inline void pv_block(const float* p, int ldp, const T* v, int ps, int keys, float* o) {
  for (int x = 0; x < D / 32; ++x) {
    __m256 c[kPvRows][4];
    for (int r = 0; r < kPvRows; ++r)
      for (int y = 0; y < 4; ++y) c[r][y] = _mm256_loadu_ps(o + r * D + 32 * x + 8 * y);
    if constexpr (Fmt == kBF16Amx) {
      for (int j = 0; j < keys; j += 2) {
        const bool two = j + 1 < keys;  // an odd tail: key j alone (p[j + 1] is not a score)
        for (int y = 0; y < 4; ++y) {
          const int dim = 32 * x + 8 * y;  // 8 dims in the 16-dim block dim / 16, half (dim % 16) / 8
          __m256 va, vb;
          load_pair(v + static_cast<int64_t>(dim / 16) * 16 * ps + j * 16 + (dim % 16) * 2, va, vb);
          for (int r = 0; r < kPvRows; ++r) {
            c[r][y] = _mm256_fmadd_ps(_mm256_set1_ps(p[r * ldp + j]), va, c[r][y]);
            if (two) c[r][y] = _mm256_fmadd_ps(_mm256_set1_ps(p[r * ldp + j + 1]), vb, c[r][y]);
          }
        }
      }
    } else {
      for (int j = 0; j < keys; ++j) {
        __m256 vv[4];
        for (int y = 0; y < 4; ++y) vv[y] = load8(v + j * D + 32 * x + 8 * y);
        for (int r = 0; r < kPvRows; ++r) {
          const __m256 a = _mm256_set1_ps(p[r * ldp + j]);
          for (int y = 0; y < 4; ++y) c[r][y] = _mm256_fmadd_ps(a, vv[y], c[r][y]);
        }
      }
    }
    for (int r = 0; r < kPvRows; ++r)
      for (int y = 0; y < 4; ++y) _mm256_storeu_ps(o + r * D + 32 * x + 8 * y, c[r][y]);
  }
}

// One KV head, queries [t0, t1): as the AVX-512 run_tile, rows padded to a multiple of 4.
template <int D, int Fmt, typename T>
UCM_AVX2 static void run_tile(const Problem& pb, int h, int64_t t0, int64_t t1, Scratch& w) {
  const int g = pb.group, ps = pb.page_size;
  const int rows = static_cast<int>(t1 - t0) * g;
  const int R = (rows + kRows - 1) / kRows * kRows;
  const int lds = ps;
  fill_queries<D>(pb, h, t0, rows, R, lds, pb.scale, w);
  const int64_t first = pb.pos[t0], last = pb.pos[t1 - 1];
  const int64_t npages = last / ps + 1;
  if (npages > pb.num_pages) throw std::out_of_range("page table shorter than the query positions");
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t p = 0; p < npages; ++p) {
    const T* kt = static_cast<const T*>(pb.pages) + pb.table[p] * pb.page_stride + h * pb.head_stride;
    const T* v = kt + static_cast<int64_t>(D) * ps;
    const int64_t base = p * ps;
    const int kend = static_cast<int>(std::min<int64_t>(ps, last + 1 - base));  // keys any row sees
    const int kpad = (kend + kKeys - 1) / kKeys * kKeys;  // <= ps (a multiple of 32)
    int r_live = 0;
    if (base > first)
      while (r_live < R && w.pos[r_live] < base) ++r_live;
    r_live = r_live / kRows * kRows;
    for (int c0 = 0; c0 < kpad; c0 += kKeys)
      for (int r0 = r_live; r0 < R; r0 += kRows)
        qk_4x16<D, Fmt>(w.q.data() + r0 * D, kt, ps, c0, w.s.data() + r0 * lds + c0, lds);
    for (int r = r_live; r < R; ++r) {
      float* srow = w.s.data() + r * lds;
      const int valid = static_cast<int>(std::clamp<int64_t>(w.pos[r] + 1 - base, 0, kend));
      if (valid == 0) {
        std::memset(srow, 0, sizeof(float) * kend);
        continue;
      }
      // Scores exist up to kpad (<= lds), so whole vectors are read; lanes at or past `valid`
      // (later keys, or unwritten slots that may hold NaN) are masked out by blend / and.
      __m256 mx = neg_inf;
      for (int j = 0; j < valid; j += 8)
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(srow + j), first_lanes(valid - j)));
      const float m_new = std::max(w.m[r], reduce_max(mx));
      const float alpha = std::exp(w.m[r] - m_new);  // 0 on the first page seen (m = -inf)
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < kend; j += 8) {
        const int vis = std::clamp(valid - j, 0, 8);
        const __m256 e = _mm256_and_ps(first_lanes(vis), exp8(_mm256_sub_ps(_mm256_loadu_ps(srow + j), mv)));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(srow + j, e);
      }
      w.l[r] = w.l[r] * alpha + reduce_add(sum);
      w.m[r] = m_new;
      if (alpha != 1.0f) {
        float* orow = w.o.data() + r * D;
        const __m256 av = _mm256_set1_ps(alpha);
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(orow + d, _mm256_mul_ps(_mm256_loadu_ps(orow + d), av));
      }
    }
    for (int r0 = r_live; r0 < R; r0 += kPvRows)
      pv_block<D, Fmt>(w.s.data() + r0 * lds, lds, v, ps, kend, w.o.data() + r0 * D);
  }
  write_out<D>(pb, h, t0, rows, w);
}

}  // namespace avx2

// Runs fn(item, scratch) for items [0, items) on the caller's thread and num_threads - 1 helpers
// pinned to `helper_cpus`; the first exception stops the rest and is rethrown.
template <typename Fn>
static void parallel_items(int64_t items, int num_threads, const std::vector<int>& helper_cpus, Fn&& fn) {
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::string error;
  auto worker = [&](int helper) {
    if (helper >= 0 && !helper_cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(helper_cpus[helper % helper_cpus.size()], &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: unpinned if refused
    }
    Scratch w;
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      try {
        fn(i, w);
      } catch (const std::exception& e) {
        if (!failed.exchange(true)) error = e.what();
        next.store(items);
      }
    }
  };
  const int extra = static_cast<int>(std::min<int64_t>(std::max(num_threads, 1), items)) - 1;
  std::vector<std::thread> threads;
  for (int i = 0; i < extra; ++i) threads.emplace_back(worker, i);
  worker(-1);
  for (auto& t : threads) t.join();
  if (failed) throw std::runtime_error(error);
}

template <int D, int Fmt, typename T, int Isa>
static void run(const Problem& pb, int num_threads, const std::vector<int>& helper_cpus) {
  const int64_t tq = pb.tile_queries;
  const int64_t ntiles = (pb.n + tq - 1) / tq;
  parallel_items(ntiles * pb.hk, num_threads, helper_cpus, [&](int64_t i, Scratch& w) {
    // Last tiles first: they see the most keys, so the tail of the schedule is short.
    const int64_t tile = ntiles - 1 - i / pb.hk;
    const int h = static_cast<int>(i % pb.hk);
    const int64_t t0 = tile * tq, t1 = std::min(pb.n, (tile + 1) * tq);
    if constexpr (Isa == kAmx)
      amx::run_tile<D>(pb, h, t0, t1, w);
    else if constexpr (Isa == kAvx512Bf16)
      run_tile<D, Fmt, T, true>(pb, h, t0, t1, w);
    else if constexpr (Isa == kAvx512)
      run_tile<D, Fmt, T>(pb, h, t0, t1, w);
    else
      avx2::run_tile<D, Fmt, T>(pb, h, t0, t1, w);
  });
}

// AMX tiles and bfloat16 products, and the kernel's permission to use tile data (Linux asks each
// process to request it once; refused, the variant is not offered).
static bool amx_usable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
    if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

static bool cpu_has(int isa) {
  if (isa == kAmx) return amx_usable();
  if (isa == kAvx512Bf16)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
  if (isa == kAvx512) return __builtin_cpu_supports("avx512f");
  return isa == kAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#else
static bool cpu_has(int) { return false; }
#endif

// ---- A stored block's KV out of the pages, token-major ---------------------------------------
// out[i + j, layer, 0 / 1, h, :] = K / V of token o + j of page `page` in that layer's cache, for each
// run (i, page, o, n): the store's block form, without torch's strided copies of permuted views
// (4-byte inner runs in the AMX tiles, a transposed K in the vec pages).
template <typename T, int Fmt>
static void gather_run(const std::vector<uintptr_t>& layers, const int64_t* run, int layer, int64_t page_stride,
                       int64_t head_stride, int H, int D, int ps, int64_t tok, int64_t lay, T* out) {
  const int64_t i = run[0], b = run[1], o = run[2], n = run[3];
  const T* page = reinterpret_cast<const T*>(layers[layer]) + b * page_stride;
  for (int h = 0; h < H; ++h) {
    const T* kp = page + h * head_stride;
    const T* vp = kp + static_cast<int64_t>(D) * ps;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = o + j;
      T* ko = out + (i + j) * tok + static_cast<int64_t>(layer) * lay + h * D;
      T* vo = ko + static_cast<int64_t>(H) * D;
      if constexpr (Fmt == kBF16Amx) {
        const T* kt = kp + (t / 16) * 16 * D + (t % 16) * 2;
        const T* vt = vp + (t / 2) * 32 + t % 2;
        for (int d = 0; d < D; ++d) {
          ko[d] = kt[(d / 2) * 32 + d % 2];
          vo[d] = vt[static_cast<int64_t>(d / 16) * 16 * ps + (d % 16) * 2];
        }
      } else {
        for (int d = 0; d < D; ++d) ko[d] = kp[static_cast<int64_t>(d) * ps + t];
        std::memcpy(vo, vp + t * D, sizeof(T) * D);
      }
    }
  }
}



// The variants this CPU runs, best first.
std::vector<int> isas() {
  std::vector<int> out;
  for (int isa : {kAmx, kAvx512Bf16, kAvx512, kAvx2})
    if (cpu_has(isa)) out.push_back(isa);
  return out;
}

bool supports(int head_dim, int page_size) {
  return !isas().empty() && (head_dim == 64 || head_dim == 128) && page_size > 0 && page_size % 32 == 0;
}

bool mass_supported(int head_dim, int page_size) {
  return supports(head_dim, page_size) && cpu_has(kAvx512);
}

#if defined(__x86_64__)
template <int D, int Isa>
static void run_format(const Problem& pb, int format, int num_threads, const std::vector<int>& helper_cpus) {
  // float32 pages have no dot or AMX variant; vec16 pages no AMX one (vLLM packs AMX pages
  // wherever it uses AMX), and on AMX CPUs the widening kernel was the faster one there.
  constexpr int kFloatIsa = Isa == kAvx512Bf16 || Isa == kAmx ? kAvx512 : Isa;
  constexpr int kVecIsa = Isa == kAmx ? kAvx512 : Isa;
  if (format == kF32)
    run<D, kF32, float, kFloatIsa>(pb, num_threads, helper_cpus);
  else if (format == kBF16)
    run<D, kBF16, uint16_t, kVecIsa>(pb, num_threads, helper_cpus);
  else
    run<D, kBF16Amx, uint16_t, Isa>(pb, num_threads, helper_cpus);
}

template <int D>
static void run_isa(const Problem& pb, int isa, int format, int num_threads, const std::vector<int>& helper_cpus) {
  if (isa == kAmx)
    run_format<D, kAmx>(pb, format, num_threads, helper_cpus);
  else if (isa == kAvx512Bf16)
    run_format<D, kAvx512Bf16>(pb, format, num_threads, helper_cpus);
  else if (isa == kAvx512)
    run_format<D, kAvx512>(pb, format, num_threads, helper_cpus);
  else
    run_format<D, kAvx2>(pb, format, num_threads, helper_cpus);
}
#endif

void paged_causal_attention(uintptr_t q, uintptr_t pos, int64_t n, uintptr_t pages, int page_format,
                            int64_t page_stride, int64_t head_stride, uintptr_t table, int64_t num_pages, int hk,
                            int group, int head_dim, int page_size, double scale, uintptr_t out, int tile_queries,
                            int num_threads, const std::vector<int>& helper_cpus, int isa) {
  if (!supports(head_dim, page_size))
    throw std::invalid_argument("paged_causal_attention: unsupported head_dim/page_size or CPU without AVX2/AVX-512F");
  const std::vector<int> available = isas();
  if (isa == kBest) isa = available.front();
  if (std::find(available.begin(), available.end(), isa) == available.end())
    throw std::invalid_argument("paged_causal_attention: this CPU cannot run the requested ISA");
  if (page_format < kF32 || page_format > kBF16Amx) throw std::invalid_argument("unknown page format");
  if (n <= 0) return;
  if (hk <= 0 || group <= 0 || tile_queries <= 0) throw std::invalid_argument("hk, group and tile must be positive");
  Problem pb{reinterpret_cast<const float*>(q), reinterpret_cast<const int64_t*>(pos), n,
             reinterpret_cast<const void*>(pages), page_stride, head_stride,
             reinterpret_cast<const int64_t*>(table), num_pages, hk, group, head_dim, page_size,
             static_cast<float>(scale), reinterpret_cast<float*>(out), tile_queries};
#if defined(__x86_64__)
  py::gil_scoped_release release;
  if (head_dim == 64)
    run_isa<64>(pb, isa, page_format, num_threads, helper_cpus);
  else
    run_isa<128>(pb, isa, page_format, num_threads, helper_cpus);
#endif
}


void paged_attention_mass(uintptr_t q, uintptr_t pos, int64_t n, uintptr_t pages, int page_format,
                          int64_t page_stride, int64_t head_stride, uintptr_t table, int64_t num_pages, int hk,
                          int group, int head_dim, int page_size, double scale, bool weigh, uintptr_t mass,
                          int num_threads, const std::vector<int>& helper_cpus) {
  if (!mass_supported(head_dim, page_size))
    throw std::invalid_argument("paged_attention_mass: unsupported head_dim/page_size or CPU without AVX-512F");
  if (page_format < kF32 || page_format > kBF16Amx) throw std::invalid_argument("unknown page format");
  if (n <= 0) return;
  if (hk <= 0 || group <= 0) throw std::invalid_argument("hk and group must be positive");
  Problem pb{reinterpret_cast<const float*>(q), reinterpret_cast<const int64_t*>(pos), n,
             reinterpret_cast<const void*>(pages), page_stride, head_stride,
             reinterpret_cast<const int64_t*>(table), num_pages, hk, group, head_dim, page_size,
             static_cast<float>(scale), nullptr, 0};
  float* out = reinterpret_cast<float*>(mass);
#if defined(__x86_64__)
  py::gil_scoped_release release;
  const bool dot = page_format != kF32 && cpu_has(kAvx512Bf16);
  auto go = [&](auto d_tag) {
    constexpr int D = decltype(d_tag)::value;
    if (page_format == kF32)
      run_mass<D, kF32, float, false>(pb, weigh, out, num_threads, helper_cpus);
    else if (page_format == kBF16)
      dot ? run_mass<D, kBF16, uint16_t, true>(pb, weigh, out, num_threads, helper_cpus)
          : run_mass<D, kBF16, uint16_t, false>(pb, weigh, out, num_threads, helper_cpus);
    else
      dot ? run_mass<D, kBF16Amx, uint16_t, true>(pb, weigh, out, num_threads, helper_cpus)
          : run_mass<D, kBF16Amx, uint16_t, false>(pb, weigh, out, num_threads, helper_cpus);
  };
  if (head_dim == 64)
    go(std::integral_constant<int, 64>{});
  else
    go(std::integral_constant<int, 128>{});
#endif
}

void gather_page_runs(const std::vector<uintptr_t>& layers, uintptr_t runs, int64_t num_runs, int page_format,
                      int elem_size, int64_t page_stride, int64_t head_stride, int H, int D, int page_size,
                      uintptr_t out, int64_t token_stride, int64_t layer_stride, int num_threads,
                      const std::vector<int>& helper_cpus) {
  if (page_format < kF32 || page_format > kBF16Amx) throw std::invalid_argument("unknown page format");
  if (page_format == kBF16Amx ? elem_size != 2 : elem_size != 2 && elem_size != 4)
    throw std::invalid_argument("gather_page_runs: element size does not fit the page format");
  if (page_format == kBF16Amx && (page_size % 32 || D % 32))
    throw std::invalid_argument("gather_page_runs: AMX pages need a page size and head size divisible by 32");
  const int64_t* r = reinterpret_cast<const int64_t*>(runs);
  const int64_t L = static_cast<int64_t>(layers.size());
  if (num_runs <= 0 || L == 0) return;
  py::gil_scoped_release release;
  auto one = [&](int64_t item) {
    const int64_t* run = r + (item / L) * 4;
    const int layer = static_cast<int>(item % L);
    if (page_format == kBF16Amx)
      gather_run<uint16_t, kBF16Amx>(layers, run, layer, page_stride, head_stride, H, D, page_size, token_stride,
                                     layer_stride, reinterpret_cast<uint16_t*>(out));
    else if (elem_size == 2)
      gather_run<uint16_t, kBF16>(layers, run, layer, page_stride, head_stride, H, D, page_size, token_stride,
                                  layer_stride, reinterpret_cast<uint16_t*>(out));
    else
      gather_run<uint32_t, kF32>(layers, run, layer, page_stride, head_stride, H, D, page_size, token_stride,
                                 layer_stride, reinterpret_cast<uint32_t*>(out));
  };
#if defined(__x86_64__)
  parallel_items(num_runs * L, num_threads, helper_cpus, [&](int64_t item, Scratch&) { one(item); });
#else
  for (int64_t item = 0; item < num_runs * L; ++item) one(item);
#endif
}

}  // namespace ucm_attn

PYBIND11_MODULE(_attention, m) {
  m.doc() = "Exact causal attention of scattered query rows over paged K/V (AVX512-BF16, AVX-512F or AVX2 + FMA).";
  m.attr("AVX512") = static_cast<int>(ucm_attn::kAvx512);
  m.attr("AVX2") = static_cast<int>(ucm_attn::kAvx2);
  m.attr("AVX512_BF16") = static_cast<int>(ucm_attn::kAvx512Bf16);
  m.attr("AMX") = static_cast<int>(ucm_attn::kAmx);
  m.def("isas", &ucm_attn::isas, "The kernel variants this CPU runs, best first.");
  m.attr("F32") = static_cast<int>(ucm_attn::kF32);
  m.attr("BF16") = static_cast<int>(ucm_attn::kBF16);
  m.attr("BF16_AMX") = static_cast<int>(ucm_attn::kBF16Amx);
  m.def("supports", &ucm_attn::supports, py::arg("head_dim"), py::arg("page_size"),
        "Whether this CPU and geometry can use the native kernel.");
  m.def("paged_causal_attention", &ucm_attn::paged_causal_attention, py::arg("q"), py::arg("pos"), py::arg("n"),
        py::arg("pages"), py::arg("page_format"), py::arg("page_stride"), py::arg("head_stride"), py::arg("table"), py::arg("num_pages"),
        py::arg("hk"), py::arg("group"), py::arg("head_dim"), py::arg("page_size"), py::arg("scale"),
        py::arg("out"), py::arg("tile_queries"), py::arg("num_threads"), py::arg("helper_cpus"), py::arg("isa") = 0,
        "Raw-pointer entry point; call it through ucm.sparse.blend.tiled_attention, which checks the tensors.");
  m.def("gather_page_runs", &ucm_attn::gather_page_runs, py::arg("layers"), py::arg("runs"), py::arg("num_runs"),
        py::arg("page_format"), py::arg("elem_size"), py::arg("page_stride"), py::arg("head_stride"), py::arg("H"),
        py::arg("D"), py::arg("page_size"), py::arg("out"), py::arg("token_stride"), py::arg("layer_stride"),
        py::arg("num_threads"), py::arg("helper_cpus"),
        "Raw-pointer entry point; call it through ucm.sparse.blend.tiled_attention.gather_page_runs.");
  m.def("mass_supported", &ucm_attn::mass_supported, py::arg("head_dim"), py::arg("page_size"),
        "Whether this CPU and geometry can use the native attention mass (AVX-512F).");
  m.def("paged_attention_mass", &ucm_attn::paged_attention_mass, py::arg("q"), py::arg("pos"), py::arg("n"),
        py::arg("pages"), py::arg("page_format"), py::arg("page_stride"), py::arg("head_stride"), py::arg("table"),
        py::arg("num_pages"), py::arg("hk"), py::arg("group"), py::arg("head_dim"), py::arg("page_size"),
        py::arg("scale"), py::arg("weigh"), py::arg("mass"), py::arg("num_threads"), py::arg("helper_cpus"),
        "Raw-pointer entry point; call it through ucm.sparse.blend.tiled_attention, which checks the tensors.");
}
