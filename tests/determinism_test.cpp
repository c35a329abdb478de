// --deterministic and --audit end to end (docs/determinism.md): real processes, small models,
// few steps. The oracle is the params digest (SHA-256 of every parameter) of one process that
// accumulates all the micro-batches itself: every layout of the same global batch and
// micro-batch must end with exactly it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_util.h"
#include "dtrain/parallel/exact.h"

namespace {

class Determinism : public CliTest {
 protected:
  // Runs `args` with --metrics; the run's params digest (empty when it failed: the test fails).
  std::string digest(const std::string& args, const std::string& name) {
    const ProcessResult r = dtrain(args + " --metrics " + path(name + ".jsonl"), 300);
    EXPECT_EQ(r.code, 0) << args << ": " << r.output;
    if (r.code != 0) return {};
    const nlohmann::json f = final_record(name + ".jsonl");
    EXPECT_TRUE(f.value("deterministic", false)) << args;
    return f["params_digest"].get<std::string>();
  }
};

// 24 micro-batches of 1 sample per step, on 1 to 8 processes: dp x accumulate = 24 always.
TEST_F(Determinism, MlpDigestIsTheSameOnEveryDataParallelLayout) {
  const std::string mlp =
      "train --model mlp --hidden 32 --batch-size 24 --steps 3 --lr 0.01 --deterministic --progress=false";
  const std::string one = digest(mlp + " --accumulate 24", "one");
  ASSERT_EQ(one.size(), 64u);
  // (dp 6 and every ZeRO stage at every dp: bench/determinism.py.)
  const std::vector<std::string> layouts = {"--dp 2 --accumulate 12", "--dp 3 --accumulate 8 --zero 1",
                                            "--dp 4 --accumulate 6 --zero 2", "--dp 8 --accumulate 3",
                                            "--dp 3 --accumulate 8 --backend tcp"};
  for (size_t i = 0; i < layouts.size(); ++i) {
    EXPECT_EQ(digest(mlp + " " + layouts[i], "l" + std::to_string(i)), one) << layouts[i];
  }
}

// One micro-batch per rank and step: the ranks' gradients are reduced straight from the
// buckets (shared memory: in place, no sums kept), an audit's recomputation leaves them alone.
TEST_F(Determinism, MlpDigestWithOneMicroBatchPerRank) {
  const std::string mlp =
      "train --model mlp --hidden 32 --batch-size 8 --steps 3 --lr 0.01 --deterministic --progress=false";
  const std::string one = digest(mlp + " --accumulate 4", "one");
  ASSERT_EQ(one.size(), 64u);
  const std::vector<std::string> layouts = {"--dp 4", "--dp 4 --zero 1 --audit 1", "--dp 4 --zero 2",
                                            "--dp 2 --accumulate 2 --zero 1 --audit 1"};
  for (size_t i = 0; i < layouts.size(); ++i) {
    EXPECT_EQ(digest(mlp + " " + layouts[i], "l" + std::to_string(i)), one) << layouts[i];
  }
}

// The GPT over data parallelism, ZeRO and pipeline stages (4 micro-batches of 2 sequences).
TEST_F(Determinism, GptDigestIsTheSameOnDataParallelAndPipelineLayouts) {
  const std::string gpt = "train --model gpt --data text:" + corpus() +
                          " --layers 4 --heads 2 --width 16 --seq-len 8 --batch-size 8 --steps 3 --deterministic"
                          " --progress=false";
  const std::string one = digest(gpt + " --accumulate 4", "one");
  ASSERT_EQ(one.size(), 64u);
  const std::vector<std::string> layouts = {"--dp 2 --accumulate 2",
                                            "--dp 4 --zero 1",
                                            "--dp 2 --accumulate 2 --zero 2",
                                            "--pp 2 --micro-batches 4",
                                            "--pp 4 --micro-batches 4 --schedule gpipe",
                                            "--dp 2 --pp 2 --micro-batches 2"};
  for (size_t i = 0; i < layouts.size(); ++i) {
    EXPECT_EQ(digest(gpt + " " + layouts[i], "l" + std::to_string(i)), one) << layouts[i];
  }
}

// A checkpoint written by one layout resumes in another and ends where the run that never
// stopped ends, bit for bit; so does an elastic run that lost a worker (dp 4 -> 3, the three
// accumulating 4 micro-batches each instead of 3).
TEST_F(Determinism, ResumedAndElasticRunsEndWithTheUnchangedRunsDigest) {
  const std::string mlp =
      "train --model mlp --hidden 32,32 --batch-size 48 --optimizer sgd --lr 0.05 --deterministic --progress=false";
  const std::string ref = digest(mlp + " --dp 4 --accumulate 3 --steps 8", "ref");
  ASSERT_EQ(ref.size(), 64u);
  ProcessResult a =
      dtrain(mlp + " --dp 2 --accumulate 6 --steps 4 --checkpoint-dir " + path("ck") + " --checkpoint-every 2");
  ASSERT_EQ(a.code, 0) << a.output;
  EXPECT_EQ(digest(mlp + " --dp 3 --accumulate 4 --zero 1 --steps 8 --checkpoint-dir " + path("ck"), "resumed"), ref);
  ::setenv("DTRAIN_FAULT", "kill:rank=3:step=5:attempt=any", 1);
  ProcessResult el = dtrain(mlp + " --dp 4 --accumulate 3 --steps 8 --checkpoint-dir " + path("el") +
                                " --checkpoint-every 2 --max-restarts 3 --min-workers 2 --metrics " + path("el.jsonl"),
                            300);
  ::unsetenv("DTRAIN_FAULT");
  ASSERT_EQ(el.code, 0) << el.output;
  EXPECT_NE(el.output.find("--accumulate 4 instead of 3"), std::string::npos) << el.output;
  EXPECT_EQ(final_record("el.jsonl")["params_digest"].get<std::string>(), ref);
}

// Layouts that cannot keep the guarantee are refused at start, saying why.
TEST_F(Determinism, LayoutsThatCannotKeepTheGuaranteeAreRefused) {
  const std::string gpt = "train --model gpt --data text:" + corpus() +
                          " --layers 2 --heads 2 --width 16 --seq-len 8 --batch-size 8 --steps 2 --deterministic"
                          " --progress=false";
  ProcessResult tp = dtrain(gpt + " --tp 2");
  EXPECT_NE(tp.code, 0);
  EXPECT_NE(tp.output.find("tensor parallelism splits the matrix products"), std::string::npos) << tp.output;
  ProcessResult c = dtrain(gpt + " --dp 2 --compress int8");
  EXPECT_NE(c.code, 0);
  EXPECT_NE(c.output.find("lossy compression"), std::string::npos) << c.output;
  ProcessResult audit = dtrain("train --model mlp --hidden 16 --batch-size 8 --steps 2 --audit 1 --progress=false");
  EXPECT_NE(audit.code, 0);
  EXPECT_NE(audit.output.find("it needs --deterministic"), std::string::npos) << audit.output;
}

// A diverged run (gradients not finite) stops at the step it happened, naming the tensor and a
// rank, on every rank: in the shared in-place reduction (any rank may find it) and on TCP.
TEST_F(Determinism, AGradientOutOfTheExactRangeStopsTheRun) {
  const std::string mlp =
      "train --model mlp --hidden 16 --batch-size 8 --steps 3 --lr 1e30 --deterministic --progress=false";
  for (const std::string layout : {"--dp 2", "--dp 2 --zero 1 --backend tcp"}) {
    ProcessResult r = dtrain(mlp + " " + layout);
    EXPECT_NE(r.code, 0) << layout;
    EXPECT_NE(r.output.find("at step 2 has an element"), std::string::npos) << layout << ": " << r.output;
    EXPECT_NE(r.output.find("outside the exact fixed-point range"), std::string::npos) << layout << ": " << r.output;
  }
}

// ZeRO 1 on shared memory checks the range in the collective that ends the step (after the
// optimizer, instead of a barrier): the run still stops at the step it diverged, on every rank.
TEST_F(Determinism, AGradientOutOfRangeStopsZeroOneOnSharedMemory) {
  ProcessResult r = dtrain(
      "train --model mlp --hidden 16 --batch-size 8 --steps 3 --lr 1e30 --deterministic --progress=false --dp 2 "
      "--zero 1");
  EXPECT_NE(r.code, 0) << r.output;
  for (const std::string rank : {"[rank 0]", "[rank 1]"}) {
    const size_t at = r.output.find(rank + " dtrain: error: [ddp] --deterministic: the gradient of '");
    ASSERT_NE(at, std::string::npos) << rank << ": " << r.output;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    EXPECT_NE(line.find("at step 2 has an element"), std::string::npos) << line;
  }
}

// A flipped gradient bit on any rank at any audited step stops the run, naming that rank, the
// step and the tensor the fault flipped; without a fault the audited run ends with the digest
// of the unaudited one.
TEST_F(Determinism, AuditCatchesEveryFlippedBitAndNamesIt) {
  const std::string mlp =
      "train --model mlp --hidden 32 --batch-size 12 --steps 4 --dp 3 --accumulate 2 --deterministic "
      "--progress=false";
  EXPECT_EQ(digest(mlp + " --audit 1", "audited"), digest(mlp, "plain"));
  const std::vector<std::pair<int, int>> flips = {{0, 1}, {1, 3}, {2, 2}, {2, 4}};
  for (const auto& [rank, step] : flips) {
    ::setenv("DTRAIN_FAULT", ("bitflip:rank=" + std::to_string(rank) + ":step=" + std::to_string(step)).c_str(), 1);
    ProcessResult r = dtrain(mlp + " --audit 1");
    ::unsetenv("DTRAIN_FAULT");
    EXPECT_NE(r.code, 0) << r.output;
    // The fault says which tensor it flipped; the audit must name the same one.
    const std::string flipped = "of the gradient of '";
    const size_t at = r.output.find(flipped);
    ASSERT_NE(at, std::string::npos) << r.output;
    const std::string tensor =
        r.output.substr(at + flipped.size(), r.output.find('\'', at + flipped.size()) - (at + flipped.size()));
    EXPECT_NE(r.output.find("--audit: at step " + std::to_string(step) + " the gradient of '" + tensor +
                            "' that rank " + std::to_string(rank) + " computed"),
              std::string::npos)
        << "flip on rank " << rank << " at step " << step << ": " << r.output;
  }
}

// The fixed-point sum does not depend on the order of its terms, and converts back exactly.
TEST(ExactSum, IsIndependentOfOrderAndGrouping) {
  const std::vector<float> g = {1e-3f, -2.5e-7f, 3.0f, 1e-12f, -7.25f, 0.1f};
  const double limit = dtrain::parallel::exact_limit(8);
  std::vector<int64_t> forward(1, 0), backward(1, 0), pairs(1, 0);
  for (float v : g) ASSERT_EQ(dtrain::parallel::exact_add(forward.data(), &v, 1, limit), 1u);
  for (size_t i = g.size(); i-- > 0;) dtrain::parallel::exact_add(backward.data(), &g[i], 1, limit);
  // Two "ranks" of three terms each, then their sums added.
  std::vector<int64_t> a(1, 0), b(1, 0);
  for (size_t i = 0; i < 3; ++i) dtrain::parallel::exact_add(a.data(), &g[i], 1, limit);
  for (size_t i = 3; i < g.size(); ++i) dtrain::parallel::exact_add(b.data(), &g[i], 1, limit);
  pairs[0] = a[0] + b[0];
  EXPECT_EQ(forward[0], backward[0]);
  EXPECT_EQ(forward[0], pairs[0]);
  float out = 0.0f;
  dtrain::parallel::exact_to_float(forward.data(), &out, 1, 2);
  double expect = 0.0;
  for (float v : g) expect += v;
  EXPECT_NEAR(out, expect / 2, 1e-6);
  // Out of range and not finite: refused, naming the index.
  const float bad[3] = {1.0f, static_cast<float>(limit), std::numeric_limits<float>::quiet_NaN()};
  std::vector<int64_t> acc(3, 0);
  EXPECT_EQ(dtrain::parallel::exact_add(acc.data(), bad, 3, limit), 1u);
  EXPECT_EQ(dtrain::parallel::exact_add(acc.data(), bad + 2, 1, limit), 0u);
  EXPECT_EQ(acc[0], 0);  // nothing added from a refused block
  // One flipped bit changes the checksum.
  std::vector<float> h = g;
  const uint64_t before = dtrain::parallel::bits_checksum(h.data(), h.size());
  uint32_t bits = 0;
  std::memcpy(&bits, &h[3], 4);
  bits ^= 1u;
  std::memcpy(&h[3], &bits, 4);
  EXPECT_NE(dtrain::parallel::bits_checksum(h.data(), h.size()), before);
}

// The vectorised loops give the bits of the scalar definition, round(g x 2^40) to nearest even
// (ties, subnormals, both signs, lengths that are not a multiple of a vector), and exact_reduce
// gives the bits of exact_add of every term followed by exact_to_float, also in place.
TEST(ExactSum, VectorLoopsMatchTheScalarDefinition) {
  using namespace dtrain::parallel;
  const size_t n = 5003;  // several of exact_reduce's blocks and a ragged end
  const int ranks = 3;
  const double limit = exact_limit(12);
  uint64_t state = 12345;
  auto next = [&state] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(state >> 32);
  };
  std::vector<std::vector<float>> g(ranks, std::vector<float>(n));
  for (auto& v : g) {
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits = next();
      const uint32_t exponent = 127 - 60 + next() % 74;  // 2^-60 .. 2^13
      bits = (bits & 0x807fffffu) | (exponent << 23);
      if (i % 7 == 0) bits &= 0x807fffffu;  // subnormal
      std::memcpy(&v[i], &bits, sizeof(bits));
      if (i % 11 == 0) v[i] = std::ldexp(static_cast<float>(next() % 1000) + 0.5f, -kExactFractionBits);  // a tie
      if (i % 13 == 0) v[i] = -v[i];
    }
  }
  std::vector<int64_t> sums(n), expect(n, 0);
  for (size_t i = 0; i < n; ++i) sums[i] = static_cast<int64_t>(next()) - (int64_t{1} << 31);
  for (int q = 0; q < ranks; ++q) {
    for (size_t i = 0; i < n; ++i) {
      const double x = static_cast<double>(g[q][i]) * std::ldexp(1.0, kExactFractionBits);
      expect[i] += std::llrint(x);  // the default rounding mode: nearest even
    }
  }
  std::vector<int64_t> acc(n, 0);
  for (int q = 0; q < ranks; ++q) ASSERT_EQ(exact_add(acc.data(), g[q].data(), n, limit), n);
  EXPECT_EQ(acc, expect);
  for (size_t i = 0; i < n; ++i) acc[i] += sums[i];
  std::vector<float> want(n), got(n);
  exact_to_float(acc.data(), want.data(), n, 12);
  const float* grads[ranks] = {g[0].data(), g[1].data(), g[2].data()};
  const int64_t* partial[ranks] = {nullptr, sums.data(), nullptr};
  EXPECT_EQ(exact_reduce(got.data(), grads, partial, ranks, n, 12, limit).rank, -1);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0);
  EXPECT_EQ(exact_reduce(g[1].data(), grads, partial, ranks, n, 12, limit).rank, -1);  // into one of the inputs
  EXPECT_EQ(std::memcmp(g[1].data(), want.data(), n * sizeof(float)), 0);
  // Out of range or not finite: the first such element, by block, then rank, then index.
  EXPECT_EQ(exact_check(g[0].data(), n, limit), n);
  g[2][4099] = static_cast<float>(-limit);
  g[0][4100] = std::numeric_limits<float>::infinity();
  g[0][4500] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(exact_check(g[2].data(), n, limit), 4099u);
  const ExactOutOfRange bad = exact_reduce(got.data(), grads, partial, ranks, n, 12, limit);
  EXPECT_EQ(bad.rank, 0);
  EXPECT_EQ(bad.index, 4100u);
  EXPECT_EQ(bad.value, std::numeric_limits<float>::infinity());
  g[0][4100] = 0.0f;
  const ExactOutOfRange other = exact_reduce(got.data(), grads, partial, ranks, n, 12, limit);
  EXPECT_EQ(other.rank, 0);  // 4500 is in the same block of 1024 as 4099: rank 0 comes first
  EXPECT_EQ(other.index, 4500u);
  g[0][4500] = 0.0f;
  const ExactOutOfRange last = exact_reduce(got.data(), grads, partial, ranks, n, 12, limit);
  EXPECT_EQ(last.rank, 2);
  EXPECT_EQ(last.index, 4099u);
  EXPECT_EQ(last.value, static_cast<float>(-limit));
}

// exact_reduce keeps a block's sum over the ranks in registers for up to four ranks and adds
// the rest in a second pass, and divides by a power of two with a multiplication: every rank
// count and divisor gives the bits of the scalar definition.
TEST(ExactSum, ReduceMatchesTheDefinitionForEveryRankCountAndDivisor) {
  using namespace dtrain::parallel;
  const size_t n = 2051;  // two blocks and a ragged end
  uint64_t state = 777;
  auto next = [&state] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(state >> 32);
  };
  for (int ranks = 1; ranks <= 7; ++ranks) {
    for (const int64_t divisor : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{8}, int64_t{6}, int64_t{7}}) {
      if (divisor < ranks) continue;
      const double limit = exact_limit(divisor);
      std::vector<std::vector<float>> g(static_cast<size_t>(ranks), std::vector<float>(n));
      for (auto& v : g) {
        for (size_t i = 0; i < n; ++i) {
          const auto exponent = static_cast<int>(next() % 70) - 60;  // 2^-60 .. 2^9
          v[i] = std::ldexp(static_cast<float>(next() % 2000001) / 1e6f - 1.0f, exponent);
          if (i % 9 == 0) v[i] = std::ldexp(static_cast<float>(next() % 100) + 0.5f, -kExactFractionBits);  // a tie
        }
      }
      std::vector<const float*> grads;
      for (const auto& v : g) grads.push_back(v.data());
      std::vector<float> want(n), got(n);
      for (size_t i = 0; i < n; ++i) {
        int64_t sum = 0;
        for (const auto& v : g) sum += std::llrint(static_cast<double>(v[i]) * std::ldexp(1.0, kExactFractionBits));
        want[i] = static_cast<float>(static_cast<double>(sum) * std::ldexp(1.0, -kExactFractionBits) /
                                     static_cast<double>(divisor));
      }
      ASSERT_EQ(exact_reduce(got.data(), grads.data(), nullptr, ranks, n, divisor, limit).rank, -1);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0) << ranks << " ranks, divisor " << divisor;
      // A fifth or later rank's element out of range is found too.
      if (ranks >= 5) {
        g[4][1500] = std::numeric_limits<float>::quiet_NaN();
        const ExactOutOfRange bad = exact_reduce(got.data(), grads.data(), nullptr, ranks, n, divisor, limit);
        EXPECT_EQ(bad.rank, 4);
        EXPECT_EQ(bad.index, 1500u);
      }
    }
  }
}

}  // namespace
