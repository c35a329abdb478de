// The vectorised kernels (tensor/kernels.h), every instruction set this CPU runs, against
// references in double over row widths around the vector widths (1, 7, 8, 15, 16, 17, 33, 128,
// 131: whole vectors, tails and single elements). Bounds: a row of n f32 terms summed in any
// order is off by at most n u sum |x| (u = 2^-24); exp and tanh add a few ulp.
#include "dtrain/tensor/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dtrain/tensor/half.h"
#include "dtrain/tensor/random.h"

namespace dtrain {
namespace {

const int64_t kWidths[] = {1, 7, 8, 15, 16, 17, 33, 128, 131};
constexpr double kU = 5.960464477539063e-08;  // 2^-24

std::vector<float> randn(int64_t n, uint64_t seed, float scale = 1.0f) {
  Generator gen(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = gen.normal() * scale;
  return v;
}

// Each instruction set this CPU runs.
std::vector<const kernels::Table*> tables() {
  std::vector<const kernels::Table*> out;
  for (const char* isa : {"avx512_bf16", "avx512", "avx2", "build"}) {
    if (const kernels::Table* t = kernels::table_for(isa)) out.push_back(t);
  }
  return out;
}

TEST(Kernels, EveryInstructionSetThisCpuRunsIsTestedAndOneIsPicked) {
  const std::vector<const kernels::Table*> all = tables();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(std::string(all.back()->isa), "build");
  const std::string picked = kernels::table().isa;
  bool found = false;
  for (const kernels::Table* t : all) found = found || picked == t->isa;
  EXPECT_TRUE(found) << picked;
  EXPECT_EQ(kernels::table_for("sse2"), nullptr);
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_NE(kernels::table_for("avx2"), nullptr);
  }
#endif
}

TEST(Kernels, LayerNormForwardAndBackwardMatchDouble) {
  for (const kernels::Table* k : tables()) {
    for (int64_t c : kWidths) {
      SCOPED_TRACE(std::string(k->isa) + " c=" + std::to_string(c));
      const int64_t rows = 3;
      const std::vector<float> x = randn(rows * c, 1 + static_cast<uint64_t>(c), 3.0f), w = randn(c, 2),
                               b = randn(c, 3), g = randn(rows * c, 4);
      std::vector<float> y(static_cast<size_t>(rows * c)), mean(3), rstd(3), gx(y.size());
      std::vector<float> gw(static_cast<size_t>(c), 0.5f), gb(static_cast<size_t>(c), -0.25f);  // accumulated into
      k->layer_norm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), rows, c, 1e-5f);
      k->layer_norm_backward(x.data(), w.data(), g.data(), mean.data(), rstd.data(), gx.data(), gw.data(), gb.data(),
                             rows, c);
      std::vector<double> gw_ref(static_cast<size_t>(c), 0.5), gb_ref(static_cast<size_t>(c), -0.25);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x.data() + r * c;
        double mu = 0, var = 0;
        for (int64_t j = 0; j < c; ++j) mu += xr[j];
        mu /= static_cast<double>(c);
        for (int64_t j = 0; j < c; ++j) var += (xr[j] - mu) * (xr[j] - mu);
        var /= static_cast<double>(c);
        const double rs = 1.0 / std::sqrt(var + 1e-5);
        EXPECT_NEAR(mean[static_cast<size_t>(r)], mu, 1e-5 * (1 + std::fabs(mu)));
        EXPECT_NEAR(rstd[static_cast<size_t>(r)], rs, 1e-5 * rs);
        double sd = 0, sdx = 0;
        for (int64_t j = 0; j < c; ++j) {
          const double xhat = (xr[j] - mu) * rs, gj = g[static_cast<size_t>(r * c + j)];
          EXPECT_NEAR(y[static_cast<size_t>(r * c + j)], xhat * w[static_cast<size_t>(j)] + b[static_cast<size_t>(j)],
                      1e-5 * (1 + std::fabs(xhat * w[static_cast<size_t>(j)])));
          sd += gj * w[static_cast<size_t>(j)];
          sdx += gj * w[static_cast<size_t>(j)] * xhat;
          gw_ref[static_cast<size_t>(j)] += gj * xhat;
          gb_ref[static_cast<size_t>(j)] += gj;
        }
        for (int64_t j = 0; j < c; ++j) {
          const double xhat = (xr[j] - mu) * rs, gj = g[static_cast<size_t>(r * c + j)];
          const double want =
              rs * (gj * w[static_cast<size_t>(j)] - sd / static_cast<double>(c) - xhat * sdx / static_cast<double>(c));
          EXPECT_NEAR(gx[static_cast<size_t>(r * c + j)], want, 1e-4 * rs * (1 + std::fabs(gj)));
        }
      }
      for (int64_t j = 0; j < c; ++j) {
        EXPECT_NEAR(gw[static_cast<size_t>(j)], gw_ref[static_cast<size_t>(j)], 1e-5 * 10);
        EXPECT_NEAR(gb[static_cast<size_t>(j)], gb_ref[static_cast<size_t>(j)], 1e-5 * 10);
      }
    }
  }
}

TEST(Kernels, SoftmaxAndCrossEntropyMatchDoubleAndStayFinite) {
  for (const kernels::Table* k : tables()) {
    for (int64_t n : kWidths) {
      SCOPED_TRACE(std::string(k->isa) + " n=" + std::to_string(n));
      const int64_t rows = 3;
      std::vector<float> x = randn(rows * n, 10 + static_cast<uint64_t>(n), 4.0f);
      x[0] = 1e4f;  // a huge logit: shifted by the row's maximum, nothing overflows
      const std::vector<float> g = randn(rows * n, 11);
      std::vector<float> p(x.size()), lp(x.size()), gp(x.size()), glp(x.size()), probs(x.size()), gce(x.size());
      k->softmax_forward(x.data(), p.data(), rows, n, false);
      k->softmax_forward(x.data(), lp.data(), rows, n, true);
      k->softmax_backward(p.data(), g.data(), gp.data(), rows, n, false);
      k->softmax_backward(lp.data(), g.data(), glp.data(), rows, n, true);
      const std::vector<int32_t> targets = {0, static_cast<int32_t>(n - 1), static_cast<int32_t>(n / 2)};
      const double loss = k->cross_entropy_forward(x.data(), targets.data(), probs.data(), rows, n);
      k->cross_entropy_backward(probs.data(), targets.data(), 0.5f, gce.data(), rows, n);
      double loss_ref = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x.data() + r * n;
        double mx = -INFINITY, z = 0, sg = 0, sgp = 0;
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, static_cast<double>(xr[j]));
        for (int64_t j = 0; j < n; ++j) z += std::exp(xr[j] - mx);
        for (int64_t j = 0; j < n; ++j) {
          const double pj = std::exp(xr[j] - mx) / z;
          sg += g[static_cast<size_t>(r * n + j)];
          sgp += g[static_cast<size_t>(r * n + j)] * pj;
        }
        loss_ref += std::log(z) + mx - xr[targets[static_cast<size_t>(r)]];
        for (int64_t j = 0; j < n; ++j) {
          const size_t i = static_cast<size_t>(r * n + j);
          const double pj = std::exp(xr[j] - mx) / z, lpj = xr[j] - mx - std::log(z);
          EXPECT_NEAR(p[i], pj, 2e-6 * pj + 1e-30);
          EXPECT_NEAR(probs[i], pj, 2e-6 * pj + 1e-30);
          EXPECT_NEAR(lp[i], lpj, 1e-6 * (std::fabs(lpj) + std::fabs(mx)) + 1e-6);
          EXPECT_NEAR(gp[i], pj * (g[i] - sgp), 1e-5 * (std::fabs(pj) * (std::fabs(g[i]) + std::fabs(sgp))) + 1e-30);
          EXPECT_NEAR(glp[i], g[i] - pj * sg, 1e-5 * (std::fabs(g[i]) + std::fabs(pj * sg)) + 1e-12);
          const double onehot = j == targets[static_cast<size_t>(r)] ? 1.0 : 0.0;
          EXPECT_NEAR(gce[i], 0.5 * (pj - onehot), 2e-6 * pj + 1e-7);
        }
      }
      EXPECT_NEAR(loss, loss_ref, 1e-5 * std::fabs(loss_ref) + 1e-2 * kU * 1e4 * 100);
    }
  }
}

TEST(Kernels, GeluAndItsGradientMatchTheExactTanhForm) {
  const double c = std::sqrt(2.0 / M_PI);
  for (const kernels::Table* k : tables()) {
    for (int64_t n : kWidths) {
      SCOPED_TRACE(std::string(k->isa) + " n=" + std::to_string(n));
      std::vector<float> x = randn(n, 20 + static_cast<uint64_t>(n), 3.0f);
      x[0] = -100.0f;  // saturated: tanh(-inf side) = -1, gelu = -0
      if (n > 1) x[1] = 100.0f;
      const std::vector<float> g = randn(n, 21);
      std::vector<float> y(x.size()), gx(x.size());
      k->gelu_forward(x.data(), y.data(), n);
      k->gelu_backward(x.data(), g.data(), gx.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const double v = x[static_cast<size_t>(i)], u = c * (v + 0.044715 * v * v * v), t = std::tanh(u);
        const double want = 0.5 * v * (1 + t);
        const double dwant =
            g[static_cast<size_t>(i)] * (0.5 * (1 + t) + 0.5 * v * (1 - t * t) * c * (1 + 3 * 0.044715 * v * v));
        EXPECT_NEAR(y[static_cast<size_t>(i)], want, 1e-6 * (1 + std::fabs(want)));
        EXPECT_NEAR(gx[static_cast<size_t>(i)], dwant, 1e-5 * (1 + std::fabs(dwant)));
      }
    }
  }
}

// GELU written as bf16 (the fc layer's output and gradient under bf16 products) is round_to_bf16
// of the f32 kernels' values, bit for bit, denormals included (the avx512_bf16 table's one-
// instruction rounding flushes them, and must then redo its pass exactly); the gradient's column
// sums are sum_rows' (row after row, added into what was there, once). And an element's value does
// not depend on where a call's range starts or ends (GELU's tails are masked vectors).
TEST(Kernels, GeluWritesBf16AsRoundToBf16Would) {
  std::vector<int64_t> widths(std::begin(kWidths), std::end(kWidths));
  widths.push_back(4100);  // rows past one 4096-value block of the AVX512_BF16 table's rerun
  for (const kernels::Table* k : tables()) {
    for (int64_t n : widths) {
      SCOPED_TRACE(std::string(k->isa) + " n=" + std::to_string(n));
      const int64_t rows = 3, total = rows * n;
      std::vector<float> x = randn(total, 60 + static_cast<uint64_t>(n), 3.0f);
      std::vector<float> g = randn(total, 61);
      x[0] = 1e-38f;                 // gelu(x) about x / 2: a denormal
      if (total > 2) g[2] = 1e-39f;  // a denormal gradient
      if (total > 3) x[3] = -100.0f;
      if (total > 4) x[total - 2] = -2e-38f;  // a denormal in the last row and block, a tail lane
      std::vector<float> y(x.size()), gx(x.size());
      k->gelu_forward(x.data(), y.data(), total);
      k->gelu_backward(x.data(), g.data(), gx.data(), total);
      std::vector<uint16_t> y_want(x.size()), gx_want(x.size()), y16(x.size()), gx16(x.size()), gx16_plain(x.size());
      for (size_t i = 0; i < x.size(); ++i) y_want[i] = f32_to_bf16(y[i]), gx_want[i] = f32_to_bf16(gx[i]);
      EXPECT_NE(y_want[0], 0) << "a denormal that rounds to a nonzero bf16";
      k->gelu_forward_bf16(x.data(), y16.data(), total);
      EXPECT_EQ(y16, y_want);
      std::vector<float> sums(static_cast<size_t>(n), 0.5f), sums_want = sums;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < n; ++j) sums_want[static_cast<size_t>(j)] += gx[static_cast<size_t>(r * n + j)];
      }
      k->gelu_backward_bf16(x.data(), g.data(), rows, n, gx16.data(), sums.data());
      k->gelu_backward_bf16(x.data(), g.data(), rows, n, gx16_plain.data(), nullptr);
      EXPECT_EQ(gx16, gx_want);
      EXPECT_EQ(gx16_plain, gx_want);
      EXPECT_EQ(std::memcmp(sums.data(), sums_want.data(), sums.size() * sizeof(float)), 0);
      // A range cut anywhere gives the same values as one call over all of it.
      for (int64_t cut : {int64_t{1}, n / 2, total - 1}) {
        if (cut <= 0 || cut >= total) continue;
        std::vector<float> parts(x.size());
        std::vector<uint16_t> parts16(x.size());
        k->gelu_forward(x.data(), parts.data(), cut);
        k->gelu_forward(x.data() + cut, parts.data() + cut, total - cut);
        k->gelu_forward_bf16(x.data(), parts16.data(), cut);
        k->gelu_forward_bf16(x.data() + cut, parts16.data() + cut, total - cut);
        EXPECT_EQ(std::memcmp(parts.data(), y.data(), y.size() * sizeof(float)), 0) << "cut " << cut;
        EXPECT_EQ(parts16, y_want) << "cut " << cut;
      }
    }
  }
}

// Layer norm's bf16 output, rounded in registers, is its f32 output rounded (denormal outputs,
// a tail lane and a row past one 4096-value block included), with the same mean and rstd.
TEST(Kernels, LayerNormWritesBf16AsRoundToBf16Would) {
  std::vector<int64_t> widths(std::begin(kWidths), std::end(kWidths));
  widths.push_back(4100);
  for (const kernels::Table* k : tables()) {
    for (int64_t c : widths) {
      SCOPED_TRACE(std::string(k->isa) + " c=" + std::to_string(c));
      const int64_t rows = 3, total = rows * c;
      const std::vector<float> x = randn(total, 70 + static_cast<uint64_t>(c), 2.0f);
      std::vector<float> w = randn(c, 71), b = randn(c, 72);
      w[0] = 1e-38f, b[0] = 0.0f;  // y about 1e-38: a denormal that rounds to a nonzero bf16
      if (c > 2) w[static_cast<size_t>(c - 1)] = -3e-39f, b[static_cast<size_t>(c - 1)] = 0.0f;  // the last lane
      std::vector<float> y(x.size()), mean(rows), rstd(rows), mean16(rows), rstd16(rows);
      k->layer_norm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), rows, c, 1e-5f);
      std::vector<uint16_t> want(x.size()), y16(x.size(), 0xdead);
      for (size_t i = 0; i < y.size(); ++i) want[i] = f32_to_bf16(y[i]);
      k->layer_norm_forward_bf16(x.data(), w.data(), b.data(), y16.data(), mean16.data(), rstd16.data(), rows, c,
                                 1e-5f);
      EXPECT_EQ(y16, want);
      EXPECT_EQ(std::memcmp(mean.data(), mean16.data(), rows * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(rstd.data(), rstd16.data(), rows * sizeof(float)), 0);
      if (c > 1) {
        EXPECT_NE(want[0], 0) << "a denormal that rounds to a nonzero bf16";
      }
    }
  }
}

// Layer norm takes rows in groups where the width is a multiple of 16 (AVX-512: 8 rows' stats,
// 4 rows' gradients at once) and one by one elsewhere: every row's mean, rstd, output (f32 and
// bf16) and input gradient, and the weight's and bias's gradients summed over the rows, are the
// bits of calling the kernels on one row at a time.
TEST(Kernels, LayerNormRowsInGroupsAreTheBitsOfOneRowAtATime) {
  for (const kernels::Table* k : tables()) {
    for (int64_t c : {int64_t{16}, int64_t{48}, int64_t{128}, int64_t{100}, int64_t{4096}}) {
      SCOPED_TRACE(std::string(k->isa) + " c=" + std::to_string(c));
      const int64_t rows = 19, total = rows * c;
      const std::vector<float> x = randn(total, 80 + static_cast<uint64_t>(c), 2.0f), g = randn(total, 81);
      const std::vector<float> w = randn(c, 82), b = randn(c, 83), gw0 = randn(c, 84), gb0 = randn(c, 85);
      struct Out {
        std::vector<float> y, mean, rstd, gx, gw, gb;
        std::vector<uint16_t> y16;
      };
      auto run = [&](int64_t step) {
        Out o{std::vector<float>(total),
              std::vector<float>(rows),
              std::vector<float>(rows),
              std::vector<float>(total),
              gw0,
              gb0,
              std::vector<uint16_t>(total)};
        std::vector<float> mean16(rows), rstd16(rows);
        for (int64_t r = 0; r < rows; r += step) {
          const int64_t n = std::min(step, rows - r), at = r * c;
          k->layer_norm_forward(x.data() + at, w.data(), b.data(), o.y.data() + at, o.mean.data() + r,
                                o.rstd.data() + r, n, c, 1e-5f);
          k->layer_norm_forward_bf16(x.data() + at, w.data(), b.data(), o.y16.data() + at, mean16.data() + r,
                                     rstd16.data() + r, n, c, 1e-5f);
          k->layer_norm_backward(x.data() + at, w.data(), g.data() + at, o.mean.data() + r, o.rstd.data() + r,
                                 o.gx.data() + at, o.gw.data(), o.gb.data(), n, c);
        }
        EXPECT_EQ(std::memcmp(mean16.data(), o.mean.data(), rows * sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(rstd16.data(), o.rstd.data(), rows * sizeof(float)), 0);
        return o;
      };
      const Out all = run(rows), one = run(1);
      auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
        return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
      };
      EXPECT_TRUE(same(all.mean, one.mean));
      EXPECT_TRUE(same(all.rstd, one.rstd));
      EXPECT_TRUE(same(all.y, one.y));
      EXPECT_EQ(all.y16, one.y16);
      EXPECT_TRUE(same(all.gx, one.gx));
      EXPECT_TRUE(same(all.gw, one.gw));
      EXPECT_TRUE(same(all.gb, one.gb));
    }
  }
}

TEST(Kernels, CausalSoftmaxRowsNormaliseThePrefixAndZeroTheRest) {
  for (const kernels::Table* k : tables()) {
    for (int64_t t : kWidths) {
      for (int64_t len : {int64_t{1}, (t + 1) / 2, t}) {
        SCOPED_TRACE(std::string(k->isa) + " t=" + std::to_string(t) + " len=" + std::to_string(len));
        std::vector<float> row = randn(t, 30 + static_cast<uint64_t>(t + len));
        const std::vector<float> s = row;
        std::vector<float> dp = randn(t, 31);
        const std::vector<float> dp0 = dp;
        k->causal_softmax_row(row.data(), len, t);
        k->causal_softmax_backward_row(row.data(), dp.data(), len, t);
        double mx = -INFINITY, z = 0, sdp = 0;
        for (int64_t j = 0; j < len; ++j) mx = std::max(mx, static_cast<double>(s[static_cast<size_t>(j)]));
        for (int64_t j = 0; j < len; ++j) z += std::exp(s[static_cast<size_t>(j)] - mx);
        for (int64_t j = 0; j < len; ++j)
          sdp += dp0[static_cast<size_t>(j)] * std::exp(s[static_cast<size_t>(j)] - mx) / z;
        for (int64_t j = 0; j < t; ++j) {
          const size_t i = static_cast<size_t>(j);
          if (j >= len) {
            EXPECT_EQ(row[i], 0.0f);
            EXPECT_EQ(dp[i], 0.0f);
            continue;
          }
          const double pj = std::exp(s[i] - mx) / z;
          EXPECT_NEAR(row[i], pj, 2e-6 * pj);
          EXPECT_NEAR(dp[i], pj * (dp0[i] - sdp), 1e-5 * pj * (std::fabs(dp0[i]) + std::fabs(sdp)) + 1e-30);
        }
      }
    }
  }
}

TEST(Kernels, SumsAndAdamWAreTheScalarArithmetic) {
  for (const kernels::Table* k : tables()) {
    for (int64_t n : kWidths) {
      SCOPED_TRACE(std::string(k->isa) + " n=" + std::to_string(n));
      const std::vector<float> a = randn(n, 40), b = randn(n, 41);
      std::vector<float> sum = a;
      k->add_into(sum.data(), b.data(), n);
      for (int64_t i = 0; i < n; ++i)
        EXPECT_EQ(sum[static_cast<size_t>(i)], a[static_cast<size_t>(i)] + b[static_cast<size_t>(i)]);
      // Rows summed in row order, element by element: exactly the scalar loop.
      std::vector<float> m = randn(5 * n, 42);
      m[0] = 3e-39f;  // denormals: the avx512_bf16 table's fast rounding redoes those rows, sums once
      m[static_cast<size_t>(3 * n - 1)] = -5e-39f;  // a middle row's last lane (a tail where n % 16)
      std::vector<float> cols(static_cast<size_t>(n), 123.0f);
      k->sum_rows(m.data(), cols.data(), 5, n);
      for (int64_t j = 0; j < n; ++j) {
        float s = 0;
        for (int64_t r = 0; r < 5; ++r) s += m[static_cast<size_t>(r * n + j)];
        EXPECT_EQ(cols[static_cast<size_t>(j)], s);
      }
      // Rounding and summing in one read: the same bits as round_to_bf16 and sum_rows apart.
      std::vector<uint16_t> fused(static_cast<size_t>(5 * n)), apart(static_cast<size_t>(5 * n));
      std::vector<float> fused_cols(static_cast<size_t>(n), -7.0f);
      k->round_to_bf16_sum_rows(m.data(), 5, n, fused.data(), fused_cols.data());
      k->round_to_bf16(m.data(), 5, n, n, apart.data());
      EXPECT_EQ(fused, apart);
      EXPECT_EQ(std::memcmp(fused_cols.data(), cols.data(), static_cast<size_t>(n) * sizeof(float)), 0);
      // AdamW: the scalar update's operations per element, up to the fused multiply-adds the
      // compiler may use in one and not the other (a few ulp).
      std::vector<float> p = randn(n, 43), mm = randn(n, 44, 0.1f), v = randn(n, 45, 0.1f);
      for (float& x : v) x = x * x;
      const std::vector<float> g = randn(n, 46);
      std::vector<float> p2 = p, m2 = mm, v2 = v;
      k->adamw(p.data(), g.data(), mm.data(), v.data(), n, 0.999f, 0.9f, 0.95f, 1e-3f, 1.25f, 1e-8f);
      for (int64_t j = 0; j < n; ++j) {
        const size_t i = static_cast<size_t>(j);
        p2[i] *= 0.999f;
        m2[i] = 0.9f * m2[i] + (1.0f - 0.9f) * g[i];
        v2[i] = 0.95f * v2[i] + (1.0f - 0.95f) * g[i] * g[i];
        p2[i] -= 1e-3f * m2[i] / (std::sqrt(v2[i]) * 1.25f + 1e-8f);
        const float ulp = std::numeric_limits<float>::epsilon();
        EXPECT_NEAR(mm[i], m2[i], 4 * ulp * (std::fabs(0.9f * m2[i]) + std::fabs(0.1f * g[i])));
        EXPECT_NEAR(v[i], v2[i], 4 * ulp * v2[i]);
        EXPECT_NEAR(p[i], p2[i], 4 * ulp * (std::fabs(p2[i]) + 1e-3f));
      }
    }
  }
}

// The streaming-store AdamW (for a host's shared parameter copy) writes the bits of the
// ordinary one, at every length and at every alignment of p (its stores are aligned inside).
TEST(Kernels, StreamingAdamWWritesTheBitsOfAdamW) {
  for (const kernels::Table* k : tables()) {
    for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{17}, int64_t{511}, int64_t{512}, int64_t{1500}, int64_t{4099}}) {
      for (int64_t shift : {0, 1, 5, 8}) {
        SCOPED_TRACE(std::string(k->isa) + " n=" + std::to_string(n) + " shift=" + std::to_string(shift));
        std::vector<float> p = randn(n + shift, 53), m = randn(n, 54, 0.1f), v = randn(n, 55, 0.1f);
        for (float& x : v) x = x * x;
        const std::vector<float> g = randn(n, 56);
        std::vector<float> p2 = p, m2 = m, v2 = v;
        for (int step = 0; step < 3; ++step) {
          k->adamw(p.data() + shift, g.data(), m.data(), v.data(), n, 0.999f, 0.9f, 0.95f, 1e-3f, 1.25f, 1e-8f);
          k->adamw_stream(p2.data() + shift, g.data(), m2.data(), v2.data(), n, 0.999f, 0.9f, 0.95f, 1e-3f, 1.25f,
                          1e-8f);
        }
        EXPECT_EQ(0, std::memcmp(p.data(), p2.data(), p.size() * sizeof(float)));
        EXPECT_EQ(0, std::memcmp(m.data(), m2.data(), m.size() * sizeof(float)));
        EXPECT_EQ(0, std::memcmp(v.data(), v2.data(), v.size() * sizeof(float)));
      }
    }
  }
}

TEST(Kernels, Bf16RoundingIsNearestEvenWithNanAndInfinityKept) {
  std::vector<float> special = {0.0f,
                                -0.0f,
                                1.0f,
                                1.00390625f,  // 1 + 2^-8: a tie, rounds to even (1)
                                1.01171875f,  // 1 + 3 * 2^-8: a tie, rounds up to even
                                std::numeric_limits<float>::infinity(),
                                -std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::quiet_NaN(),
                                std::numeric_limits<float>::denorm_min(),
                                std::ldexp(1.0f, -127),   // a denormal: bf16 0x0040 (vcvtneps2bf16 gives 0)
                                -std::ldexp(3.0f, -130),  // another, negative
                                std::numeric_limits<float>::max(),
                                -3.14159f};
  const std::vector<float> more = randn(100, 50, 1e3f);
  special.insert(special.end(), more.begin(), more.end());
  for (const kernels::Table* k : tables()) {
    SCOPED_TRACE(k->isa);
    // As a 3 x 37 block inside rows of 40 (the padding is not read into the packed result).
    std::vector<float> src(3 * 40, 7.0f);
    for (size_t i = 0; i < 3 * 37; ++i) src[(i / 37) * 40 + i % 37] = special[i % special.size()];
    std::vector<uint16_t> packed(3 * 37);
    std::vector<float> values(3 * 37);
    k->round_to_bf16(src.data(), 3, 37, 40, packed.data());
    k->round_to_bf16_values(src.data(), 3, 37, 40, values.data());
    for (size_t i = 0; i < packed.size(); ++i) {
      const float x = src[(i / 37) * 40 + i % 37];
      EXPECT_EQ(packed[i], f32_to_bf16(x)) << x;
      const float back = bf16_to_f32(f32_to_bf16(x));
      if (std::isnan(x)) {
        EXPECT_TRUE(std::isnan(values[i]));
      } else {
        EXPECT_EQ(std::memcmp(&values[i], &back, 4), 0) << x;
      }
    }
  }
}

}  // namespace
}  // namespace dtrain
