// Fused causal self-attention.
//
// Vocabulary: qkv (B, T, 3C) holds, per position, the query, key and value vectors of all
// heads side by side: q = qkv[..., 0:C], k = qkv[..., C:2C], v = qkv[..., 2C:3C]; head h
// owns columns [h*hd, (h+1)*hd) of each, hd = C / H. Per (b, h):
//   S = scale * Q K^T (T, T), scale = 1/sqrt(hd); S[i][j] = -inf for j > i (causal mask)
//   P = softmax(S) row-wise; O = P V (T, hd), written into out[b, :, h*hd:(h+1)*hd].
// Heads are read in place with leading dimension 3C, so no head is ever copied out. The
// library's route saves P (B, H, T, T) for the backward pass; the kernels' route saves only each
// row's softmax stats (B, H, T, 2) and computes P again (below):
//   dP = dO V^T; dS = P * (dP - rowsum(dP * P)); dQ = scale dS K; dK = scale dS^T Q; dV = P^T dO.
// With bf16 products (from a head dimension of attention_bf16_min_head_dim() up; below it the
// products stay f32 under --precision bf16 too), qkv and dO are rounded to bf16 once (qkv is
// kept in bf16 for the backward), and P and dS per head just before their products; softmax and
// its gradient stay f32.
//
// Where the kernels' instruction set is AVX-512, the products run on dtrain's own kernels
// (dot_tiles.h; forward_head_dot and forward_head_f32 below): f32 on FMA, bf16 where the CPU also
// has AVX512_BF16. Elsewhere on the library's products (sgemm_f32, gemm_bf16), block by block as
// follows.
//
// Causal blocks: the rows are cut into blocks of attention_block_rows() (64) and each product
// skips what the mask makes zero: the rows [r0, r1) of S and dP need only the keys [0, r1), the
// rows of O and dQ sum only over those keys, and the rows [c0, c1) of dK and dV only over the
// queries [c0, T). At T = 128 that is 3/4 of the full products' work, at T = 1024 about 9/16.
// Entries of S and dP outside a block's keys are never computed: the softmax rows write zeros
// there, so P and dS are whole for the products that read them. T up to one block is one product
// per head, as before.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "bf16_out.h"
#include "dot_tiles.h"
#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/gemm.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/profile.h"

namespace dtrain::ops {

namespace {

// An operand of one of the attention's products: f32 values, or values already rounded to bf16
// (bf16 products), with its row stride.
struct Operand {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  int64_t ld = 0;
  Operand(const float* p, int64_t stride) : f32(p), ld(stride) {}
  Operand(const uint16_t* p, int64_t stride) : bf16(p), ld(stride) {}
};

const uint16_t* bits(const Tensor& t) { return static_cast<const uint16_t*>(t.raw_data()); }

int64_t g_block_rows = 64;
int64_t g_bf16_min_head_dim = 0;  // 0: the default for this CPU
bool g_dot = true;

// Operand `o` moved by `offset` elements (bf16 or f32 alike).
Operand at(const Operand& o, int64_t offset) {
  return o.bf16 != nullptr ? Operand{o.bf16 + offset, o.ld} : Operand{o.f32 + offset, o.ld};
}

// C (M, N) = alpha op(A) op(B): f32 products on f32 operands (whatever --precision says: the
// op chose them), gemm_bf16 on bf16 ones.
void product(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Operand& a, const Operand& b,
             float* c, int64_t ldc) {
  if (a.bf16 != nullptr) {
    gemm_bf16(ta, tb, m, n, k, alpha, a.bf16, a.ld, b.bf16, b.ld, 0.0f, c, ldc);
  } else {
    sgemm_f32(ta, tb, m, n, k, alpha, a.f32, a.ld, b.f32, b.ld, 0.0f, c, ldc);
  }
}

// A head's (T, T) probabilities (or their gradient) as an operand: as they are, or rounded into
// `rounded` when it has room (bf16 products). Every entry is defined (zeros above the diagonal).
Operand probabilities(const float* p, int64_t t, std::vector<uint16_t>& rounded) {
  if (rounded.empty()) return {p, t};
  kernels::table().round_to_bf16(p, t, t, t, rounded.data());
  return {rounded.data(), t};
}

// A tensor of (B, T, ...) rows, `row_bytes` each: its sequence b starts b * T rows in.
struct Rows {
  const void* base;  // null: none
  int64_t row_bytes;
  bool write = false;  // to be written (its lines fetched for writing)
};

// Up to this many bytes of the next sequence (the byte GPT's T = 128 backward asks for 320 KiB):
// more would push the running head's operands out of a 1 MiB L2, and at T = 512 and 1024 the
// prefetch measured no gain (attention 38.9 against 39.3 and 73.0 against 74.4 ms a step).
constexpr int64_t kPrefetchBytes = int64_t{384} << 10;

// The bf16 kernels run a sequence's heads one after the other, and a head reads (or writes) only
// its 64 or 128 bytes of each of the sequence's rows. While head h of sequence b runs, this asks
// for the h-th share of sequence b + 1's rows, whole, to come into the cache, so that the next
// sequence's heads find them there instead of each waiting for memory in its turn (the same
// bits). Measured on the byte GPT, 5 interleaved runs: bf16 attention 7.77 -> 7.05 ms a step; the
// f32 kernels' attention gained nothing from it (11.32 against 11.41), so they go without.
void prefetch_next_sequence(int64_t b, int64_t batch, int64_t h, int64_t heads, int64_t T,
                            std::initializer_list<Rows> tensors) {
  if (b + 1 >= batch) return;
  int64_t bytes = 0;
  for (const Rows& t : tensors) bytes += t.base != nullptr ? T * t.row_bytes : 0;
  if (bytes > kPrefetchBytes) return;
  for (const Rows& t : tensors) {
    if (t.base == nullptr) continue;
    const char* next = static_cast<const char*>(t.base) + (b + 1) * T * t.row_bytes;
    for (int64_t i = h * T / heads; i < (h + 1) * T / heads; ++i) {
      for (int64_t at = 0; at < t.row_bytes; at += 64) {
        if (t.write) {
          __builtin_prefetch(next + i * t.row_bytes + at, 1, 2);
        } else {
          __builtin_prefetch(next + i * t.row_bytes + at, 0, 2);
        }
      }
    }
  }
}

// bf16 products on dot_tiles.h's kernel (AVX512_BF16) where the CPU has it, instead of a library
// call per block: the rows are taken kDotRows at a time, and each tile's scores, softmax, rounding
// and product with V (or, backward, dP, dS, its rounding and dQ) run in one pass while the tile is
// in cache. A tile's keys stop at its last row (the causal mask), so about half of the full
// products' work is done, and only the rounded values a product reads are rounded. Operands are
// packed once per head (dot_tiles.h's pairs); dS and P are packed tile by tile for dK and dV.
constexpr int64_t kDotRows = 8;

// Like FlashAttention, the kernels' route keeps no (T, T) probabilities between forward and
// backward: the forward saves each row's softmax shift and 1 / sum (stats, (T, 2) per head), and
// the backward computes S again, tile by tile, and P from it (causal_softmax_recompute_tile: the
// same bits). Writing P out and reading it back cost more than that, since a layer's P (B H T^2
// floats: 4 MiB for the byte GPT) does not stay in cache between the two; and the memory saved
// grows with T^2.
struct DotScratch {
  std::vector<uint16_t> a, b, c, kt, tile, ds, p;
  std::vector<float> s, d;  // a tile of rows of S then P, and (backward) of dP then dS
  DotScratch(int64_t t, int64_t hd, bool backward) {
    const auto pairs = [](int64_t k) { return static_cast<size_t>((k + 1) / 2); };
    a.resize(pairs(hd) * 2 * t);  // K^T (forward) or V^T (backward), pairs of hd
    b.resize(pairs(t) * 2 * hd);  // V (forward), K then Q (backward), pairs of keys
    tile.resize(static_cast<size_t>(kDotRows * t));
    s.resize(static_cast<size_t>(kDotRows * t));
    if (backward) {
      d.resize(static_cast<size_t>(kDotRows * t));
      kt.resize(pairs(hd) * 2 * t);  // K^T, pairs of hd
      c.resize(pairs(t) * 2 * hd);   // dO, pairs of queries
      ds.resize(pairs(t) * 2 * t);   // dS and P, pairs of queries
      p.resize(pairs(t) * 2 * t);
    }
  }
};

// The rows from i0 up to (and including) a tile past their diagonal: what a tile of rows writes of
// P and dS (zeros past the diagonal included), since dK's and dV's tiles of keys [c0, c0 +
// kDotRows) read them from the query c0 on.
int64_t tile_columns(int64_t T, int64_t n) { return std::min(T, n + kDotRows); }

// One head: S = scale Q K^T, P = softmax (its stats saved, (T, 2)), O = P V into o (row stride
// ldo). q, k, v are bf16 with row stride ld.
void forward_head_dot(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t ld, int64_t T, int64_t hd,
                      float scale, float* stats, float* o, int64_t ldo, DotScratch& s) {
  detail::pack_pairs_transposed(k, ld, T, hd, s.a.data(), 2 * T);
  detail::pack_pairs(v, ld, T, hd, s.b.data(), 2 * hd);
  for (int64_t i0 = 0; i0 < T; i0 += kDotRows) {
    const int64_t r = std::min(kDotRows, T - i0), n = i0 + r;  // rows [i0, n) see keys [0, n)
    detail::bf16_dot_gemm(r, n, hd, scale, q + i0 * ld, ld, 2, s.a.data(), 2 * T, s.s.data(), T);
    detail::causal_softmax_tile(s.s.data(), T, i0, r, n, s.tile.data(), stats + 2 * i0);
    detail::bf16_dot_gemm(r, hd, n, 1.0f, s.tile.data(), n, 2, s.b.data(), 2 * hd, o + i0 * ldo, ldo);
  }
}

// One head's backward from the forward's stats and dO (bf16, row stride ldg): dQ, dK, dV (row
// stride ld). Only the bf16 pairs of dS and P outlive a tile of rows: f32 S, P, dP and dS stay
// a tile's rows (in L1 at the byte GPT's T = 128, and in L2 up to T = 4096).
void backward_head_dot(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t ld, const uint16_t* dO,
                       int64_t ldg, const float* stats, int64_t T, int64_t hd, float scale, float* dq, float* dk,
                       float* dv, DotScratch& s) {
  detail::pack_pairs_transposed(k, ld, T, hd, s.kt.data(), 2 * T);
  detail::pack_pairs_transposed(v, ld, T, hd, s.a.data(), 2 * T);
  detail::pack_pairs(k, ld, T, hd, s.b.data(), 2 * hd);
  float* p = s.s.data();
  float* dp = s.d.data();
  for (int64_t i0 = 0; i0 < T; i0 += kDotRows) {
    const int64_t r = std::min(kDotRows, T - i0), n = i0 + r;
    const int64_t cols = tile_columns(T, n);
    detail::bf16_dot_gemm(r, n, hd, scale, q + i0 * ld, ld, 2, s.kt.data(), 2 * T, p, T);  // the forward's S
    // P and dS also in pairs of rows for dK and dV, up to the columns their tiles read.
    detail::causal_softmax_recompute_tile(p, T, i0, r, cols, stats + 2 * i0, s.p.data() + i0 * T, 2 * T);
    detail::bf16_dot_gemm(r, n, hd, 1.0f, dO + i0 * ldg, ldg, 2, s.a.data(), 2 * T, dp, T);
    detail::causal_softmax_backward_tile(p, dp, T, i0, r, cols, s.tile.data(), s.ds.data() + i0 * T, 2 * T);
    detail::bf16_dot_gemm(r, hd, n, scale, s.tile.data(), n, 2, s.b.data(), 2 * hd, dq + i0 * ld, ld);
  }
  detail::pack_pairs(q, ld, T, hd, s.b.data(), 2 * hd);
  detail::pack_pairs(dO, ldg, T, hd, s.c.data(), 2 * hd);
  for (int64_t c0 = 0; c0 < T; c0 += kDotRows) {                   // keys [c0, c0 + r): dK = scale dS^T Q, dV = P^T dO
    const int64_t r = std::min(kDotRows, T - c0), pair0 = c0 / 2;  // c0 is even: queries from c0
    detail::bf16_dot_gemm(r, hd, T - c0, scale, s.ds.data() + 2 * c0 + pair0 * 2 * T, 2, 2 * T,
                          s.b.data() + pair0 * 2 * hd, 2 * hd, dk + c0 * ld, ld);
    detail::bf16_dot_gemm(r, hd, T - c0, 1.0f, s.p.data() + 2 * c0 + pair0 * 2 * T, 2, 2 * T,
                          s.c.data() + pair0 * 2 * hd, 2 * hd, dv + c0 * ld, ld);
  }
}

// The same tiles in f32 (dot_tiles.h's FMA kernel, any AVX-512 CPU). The B operands are copied
// into contiguous (T, hd) blocks first: read in place, their rows 3C floats apart fall into a few
// of L1's sets (1536 bytes apart: 8 sets for 128 rows) and evict each other. dS^T and P^T are
// read as A straight from their (T, T) rows.
struct F32Scratch {
  std::vector<float> t, kt, x, y, s;  // V^T, K^T (hd, T); V, or K then Q (T, hd); dO (T, hd); S then P
  F32Scratch(int64_t t_size, int64_t hd, bool backward) {
    t.resize(static_cast<size_t>(hd * t_size));
    x.resize(static_cast<size_t>(t_size * hd));
    s.resize(static_cast<size_t>((backward ? t_size : kDotRows) * t_size));
    if (backward) {
      kt.resize(static_cast<size_t>(hd * t_size));
      y.resize(static_cast<size_t>(t_size * hd));
    }
  }
};

// Rows of x (row stride ld), hd values each, into dst contiguous.
void copy_rows(const float* x, int64_t ld, int64_t rows, int64_t hd, float* dst) {
  for (int64_t i = 0; i < rows; ++i) std::copy(x + i * ld, x + i * ld + hd, dst + i * hd);
}

void forward_head_f32(const float* q, const float* k, const float* v, int64_t ld, int64_t T, int64_t hd, float scale,
                      float* stats, float* o, int64_t ldo, F32Scratch& s) {
  detail::pack_transposed(k, ld, T, hd, s.t.data(), T);
  copy_rows(v, ld, T, hd, s.x.data());
  for (int64_t i0 = 0; i0 < T; i0 += kDotRows) {
    const int64_t r = std::min(kDotRows, T - i0), n = i0 + r;
    detail::f32_dot_gemm(r, n, hd, scale, q + i0 * ld, ld, 1, s.t.data(), T, s.s.data(), T);
    detail::causal_softmax_tile(s.s.data(), T, i0, r, n, nullptr, stats + 2 * i0);
    detail::f32_dot_gemm(r, hd, n, 1.0f, s.s.data(), T, 1, s.x.data(), hd, o + i0 * ldo, ldo);
  }
}

void backward_head_f32(const float* q, const float* k, const float* v, int64_t ld, const float* dO, int64_t ldg,
                       const float* stats, int64_t T, int64_t hd, float scale, float* dp, float* dq, float* dk,
                       float* dv, F32Scratch& s) {
  detail::pack_transposed(k, ld, T, hd, s.kt.data(), T);
  detail::pack_transposed(v, ld, T, hd, s.t.data(), T);
  copy_rows(k, ld, T, hd, s.x.data());
  float* p = s.s.data();
  for (int64_t i0 = 0; i0 < T; i0 += kDotRows) {
    const int64_t r = std::min(kDotRows, T - i0), n = i0 + r;
    const int64_t cols = tile_columns(T, n);
    detail::f32_dot_gemm(r, n, hd, scale, q + i0 * ld, ld, 1, s.kt.data(), T, p + i0 * T, T);  // the forward's S
    detail::causal_softmax_recompute_tile(p + i0 * T, T, i0, r, cols, stats + 2 * i0);
    detail::f32_dot_gemm(r, n, hd, 1.0f, dO + i0 * ldg, ldg, 1, s.t.data(), T, dp + i0 * T, T);
    detail::causal_softmax_backward_tile(p + i0 * T, dp + i0 * T, T, i0, r, cols, nullptr);
    detail::f32_dot_gemm(r, hd, n, scale, dp + i0 * T, T, 1, s.x.data(), hd, dq + i0 * ld, ld);
  }
  copy_rows(q, ld, T, hd, s.x.data());
  copy_rows(dO, ldg, T, hd, s.y.data());
  for (int64_t c0 = 0; c0 < T; c0 += kDotRows) {  // keys [c0, c0 + r): dK = scale dS^T Q, dV = P^T dO
    const int64_t r = std::min(kDotRows, T - c0);
    detail::f32_dot_gemm(r, hd, T - c0, scale, dp + c0 * T + c0, 1, T, s.x.data() + c0 * hd, hd, dk + c0 * ld, ld);
    detail::f32_dot_gemm(r, hd, T - c0, 1.0f, p + c0 * T + c0, 1, T, s.y.data() + c0 * hd, hd, dv + c0 * ld, ld);
  }
}

struct AttentionBackward : Node {
  Tensor qkv;  // (B, T, 3C) contiguous: f32, or bf16 under bf16 products
  Tensor att;  // (B, H, T, T) probabilities on the library's route; (B, H, T, 2) softmax stats on the kernels'
  int64_t b_size, t_size, c_size, n_head;
  bool dot = false;  // the forward ran on dot_tiles.h's kernel: so does the backward
  std::vector<Tensor> apply(const Tensor& g_in) override {
    Tensor g = g_in.contiguous();  // (B, T, C)
    const int64_t T = t_size, C = c_size, H = n_head, hd = C / H;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    Tensor dqkv = Tensor::empty({b_size, T, 3 * C});
    const kernels::Table& kern = kernels::table();
    const bool bf16 = qkv.dtype() == DType::bf16;
    std::vector<float> dp(dot && bf16 ? 0 : static_cast<size_t>(T * T));  // dP then dS, (T, T) f32
    const Tensor g16 = bf16 ? g.to(DType::bf16) : Tensor();
    std::vector<uint16_t> rounded(bf16 ? static_cast<size_t>(T * T) : 0);
    auto heads = [&](int64_t offset) {
      return bf16 ? Operand{bits(qkv) + offset, 3 * C} : Operand{qkv.data() + offset, 3 * C};
    };
    auto grads = [&](int64_t offset) { return bf16 ? Operand{bits(g16) + offset, C} : Operand{g.data() + offset, C}; };
    const float* pa = att.data();
    float* pd = dqkv.data();
    if (dot && !bf16) {
      F32Scratch scratch(T, hd, true);
      for (int64_t b = 0; b < b_size; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t q = b * T * 3 * C + h * hd, go = b * T * C + h * hd;
          const float* x = qkv.data();
          backward_head_f32(x + q, x + q + C, x + q + 2 * C, 3 * C, g.data() + go, C, pa + (b * H + h) * T * 2, T, hd,
                            scale, dp.data(), pd + q, pd + q + C, pd + q + 2 * C, scratch);
        }
      }
      return {dqkv};
    }
    if (dot) {
      DotScratch scratch(T, hd, true);
      for (int64_t b = 0; b < b_size; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          prefetch_next_sequence(b, b_size, h, H, T, {{bits(qkv), 6 * C}, {bits(g16), 2 * C}, {pd, 12 * C, true}});
          const int64_t q = b * T * 3 * C + h * hd, go = b * T * C + h * hd;
          backward_head_dot(bits(qkv) + q, bits(qkv) + q + C, bits(qkv) + q + 2 * C, 3 * C, bits(g16) + go, C,
                            pa + (b * H + h) * T * 2, T, hd, scale, pd + q, pd + q + C, pd + q + 2 * C, scratch);
        }
      }
      return {dqkv};
    }
    const int64_t block = g_block_rows;
    for (int64_t b = 0; b < b_size; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t q = b * T * 3 * C + h * hd;  // offsets of Q, K = q + C, V = q + 2C (and of dQ, dK, dV)
        const int64_t go = b * T * C + h * hd;
        const float* p = pa + (b * H + h) * T * T;
        const Operand dO = grads(go), Q = heads(q), K = heads(q + C), V = heads(q + 2 * C);
        // dP = dO V^T on each row block's keys; dS = P * (dP - rowsum(dP * P)) in place in dp,
        // zeros written past the diagonal (P = 0 there).
        for (int64_t r0 = 0; r0 < T; r0 += block) {
          const int64_t r1 = std::min(T, r0 + block);
          product(false, true, r1 - r0, r1, hd, 1.0f, at(dO, r0 * C), V, dp.data() + r0 * T, T);
          for (int64_t i = r0; i < r1; ++i) kern.causal_softmax_backward_row(p + i * T, dp.data() + i * T, i + 1, T);
        }
        const Operand ds = probabilities(dp.data(), T, rounded);
        for (int64_t r0 = 0; r0 < T; r0 += block) {  // dQ rows [r0, r1) = scale dS[r0:r1, 0:r1] K[0:r1]
          const int64_t r1 = std::min(T, r0 + block);
          product(false, false, r1 - r0, hd, r1, scale, at(ds, r0 * T), K, pd + q + r0 * 3 * C, 3 * C);
        }
        for (int64_t c0 = 0; c0 < T; c0 += block) {  // dK rows [c0, c1) = scale dS[c0:T, c0:c1]^T Q[c0:T]
          const int64_t c1 = std::min(T, c0 + block);
          product(true, false, c1 - c0, hd, T - c0, scale, at(ds, c0 * T + c0), at(Q, c0 * 3 * C),
                  pd + q + C + c0 * 3 * C, 3 * C);
        }
        const Operand pr = probabilities(p, T, rounded);
        for (int64_t c0 = 0; c0 < T; c0 += block) {  // dV rows [c0, c1) = P[c0:T, c0:c1]^T dO[c0:T]
          const int64_t c1 = std::min(T, c0 + block);
          product(true, false, c1 - c0, hd, T - c0, 1.0f, at(pr, c0 * T + c0), at(dO, c0 * C),
                  pd + q + 2 * C + c0 * 3 * C, 3 * C);
        }
      }
    }
    return {dqkv};
  }
  void release() override { qkv = att = Tensor(); }
  const char* name() const override { return "causal_attention"; }
  profile::Kind profile_kind() const override { return profile::Kind::attention; }
};

}  // namespace

int64_t attention_block_rows() { return g_block_rows; }

int64_t attention_bf16_min_head_dim() {
  if (g_bf16_min_head_dim > 0) return g_bf16_min_head_dim;
  return attention_bf16_kernel() ? 1 : 128;
}

bool attention_bf16_kernel() { return g_dot && detail::bf16_dot_available(); }

bool attention_f32_kernel() { return g_dot && detail::f32_dot_available(); }

void set_attention_kernels(bool enabled) { g_dot = enabled; }

const char* attention_bf16_route(int64_t head_dim) {
  if (!attention_products_bf16(head_dim)) return "f32";
  return attention_bf16_kernel() ? "dtrain's AVX512_BF16 kernel" : "the bf16 product route (block by block)";
}

void set_attention_bf16_min_head_dim(int64_t head_dim) {
  DT_CHECK(head_dim >= 0, "tensor", "set_attention_bf16_min_head_dim: {}, expected at least 0 (0: the default)",
           head_dim);
  g_bf16_min_head_dim = head_dim;
}

bool attention_products_bf16(int64_t head_dim) {
  return matmul_precision() == Precision::bf16 && head_dim >= attention_bf16_min_head_dim();
}

void set_attention_block_rows(int64_t rows) {
  DT_CHECK(rows > 0, "tensor", "set_attention_block_rows: {} rows, expected at least 1", rows);
  g_block_rows = rows;
}

Tensor causal_attention(const Tensor& qkv_in, int64_t n_head, DType out_dtype) {
  profile::Scope scope(profile::Kind::attention);
  detail::check_out_dtype(out_dtype, "causal_attention");
  DT_CHECK(qkv_in.defined(), "tensor", "causal_attention: qkv is undefined");
  DT_CHECK(qkv_in.dtype() == DType::f32 || qkv_in.dtype() == DType::bf16, "tensor",
           "causal_attention: qkv {} is {}, expected f32 (or bf16 under bf16 products)", shape_str(qkv_in.shape()),
           dtype_name(qkv_in.dtype()));
  DT_CHECK(qkv_in.dim() == 3 && qkv_in.size(2) % 3 == 0, "tensor", "causal_attention: qkv must be (B, T, 3C), got {}",
           shape_str(qkv_in.shape()));
  const int64_t B = qkv_in.size(0), T = qkv_in.size(1), C = qkv_in.size(2) / 3;
  DT_CHECK(n_head > 0 && C % n_head == 0, "tensor", "causal_attention: width {} not divisible by {} heads", C, n_head);
  const int64_t H = n_head, hd = C / H;
  const float scale = hd > 0 ? 1.0f / std::sqrt(static_cast<float>(hd)) : 1.0f;
  // A bf16 qkv is what the products would round it to (linear's bf16 output): only for bf16 products.
  const bool in16 = qkv_in.dtype() == DType::bf16;
  DT_CHECK(!in16 || attention_products_bf16(hd), "tensor",
           "causal_attention: qkv {} is bf16, which needs bf16 products (--precision bf16, head dimension {} at least "
           "{})",
           shape_str(qkv_in.shape()), hd, attention_bf16_min_head_dim());
  Tensor qkv = qkv_in.detach().contiguous();
  Tensor out = Tensor::empty({B, T, C}, out_dtype);
  // bf16 products: qkv rounded once (and kept for the backward instead of its f32 values), P per head.
  const bool bf16 = attention_products_bf16(hd);
  const bool dot = T > 0 && hd > 0 && (bf16 ? attention_bf16_kernel() : attention_f32_kernel());
  Tensor att = Tensor::empty({B, H, T, dot ? 2 : T});  // the kernels' route saves the softmax's stats only
  const float* pq = in16 ? nullptr : qkv.data();
  const kernels::Table& kern = kernels::table();
  // A bf16 output: the kernels' routes write a sequence's f32 output at a time into ob (in L2) and
  // round it into out; the library's route writes all of it in f32 (out32) and rounds at the end.
  const bool out16 = out_dtype == DType::bf16;
  auto* po16 = out16 ? static_cast<uint16_t*>(out.raw_data()) : nullptr;
  std::vector<float> ob(out16 && dot ? static_cast<size_t>(T * C) : 0);
  Tensor out32 = out16 && !dot ? Tensor::empty({B, T, C}) : Tensor();
  float* po = out16 ? (dot ? nullptr : out32.data()) : out.data();
  auto out_of = [&](int64_t b) { return out16 ? ob.data() : po + b * T * C; };
  auto round_out = [&](int64_t b) {
    if (out16) kern.round_to_bf16(ob.data(), 1, T * C, T * C, po16 + b * T * C);
  };
  float* pa = att.data();
  const int64_t block = g_block_rows;
  const Tensor qkv16 = bf16 ? (in16 ? qkv : qkv.to(DType::bf16)) : Tensor();
  std::vector<uint16_t> p16(bf16 ? static_cast<size_t>(T * T) : 0);
  auto heads = [&](int64_t offset) {
    return bf16 ? Operand{bits(qkv16) + offset, 3 * C} : Operand{pq + offset, 3 * C};
  };
  if (dot && !bf16) {
    F32Scratch scratch(T, hd, false);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t q = b * T * 3 * C + h * hd;
        forward_head_f32(pq + q, pq + q + C, pq + q + 2 * C, 3 * C, T, hd, scale, pa + (b * H + h) * T * 2,
                         out_of(b) + h * hd, C, scratch);
      }
      round_out(b);
    }
  }
  if (dot && bf16) {
    DotScratch scratch(T, hd, false);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        prefetch_next_sequence(b, B, h, H, T, {{bits(qkv16), 6 * C}, {po, 4 * C, true}});
        const int64_t q = b * T * 3 * C + h * hd;
        forward_head_dot(bits(qkv16) + q, bits(qkv16) + q + C, bits(qkv16) + q + 2 * C, 3 * C, T, hd, scale,
                         pa + (b * H + h) * T * 2, out_of(b) + h * hd, C, scratch);
      }
      round_out(b);
    }
  }
  for (int64_t b = 0; b < B && T > 0 && hd > 0 && !dot; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t q = b * T * 3 * C + h * hd;  // offsets of Q, K = q + C, V = q + 2C
      float* p = pa + (b * H + h) * T * T;
      const Operand Q = heads(q), K = heads(q + C), V = heads(q + 2 * C);
      for (int64_t r0 = 0; r0 < T; r0 += block) {  // S rows [r0, r1) on keys [0, r1), softmax, zeros after
        const int64_t r1 = std::min(T, r0 + block);
        product(false, true, r1 - r0, r1, hd, scale, at(Q, r0 * 3 * C), K, p + r0 * T, T);
        for (int64_t i = r0; i < r1; ++i) kern.causal_softmax_row(p + i * T, i + 1, T);
      }
      const Operand pr = probabilities(p, T, p16);
      for (int64_t r0 = 0; r0 < T; r0 += block) {  // O rows [r0, r1) = P[r0:r1, 0:r1] V[0:r1]
        const int64_t r1 = std::min(T, r0 + block);
        product(false, false, r1 - r0, hd, r1, 1.0f, at(pr, r0 * T), V, po + (b * T + r0) * C + h * hd, C);
      }
    }
  }
  if (hd == 0 || T == 0) {
    if (out16) {
      std::fill_n(po16, out.numel(), uint16_t{0});
    } else {
      out.fill_(0.0f);
    }
  } else if (out16 && !dot) {
    kern.round_to_bf16(out32.data(), 1, out.numel(), out.numel(), po16);
  }
  if (autograd::needs_grad({&qkv_in})) {
    auto node = std::make_shared<AttentionBackward>();
    node->qkv = bf16 ? qkv16 : qkv;
    node->att = att;
    node->b_size = B;
    node->t_size = T;
    node->c_size = C;
    node->n_head = H;
    node->dot = dot;
    autograd::attach(out, node, {&qkv_in});
  }
  return out;
}

}  // namespace dtrain::ops
