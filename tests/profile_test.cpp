// --profile (tensor/profile.h): exclusive time per op kind and phase, and the trainer's report;
// MFU against the measured peak in the final record.
#include "dtrain/tensor/profile.h"

#include <gtest/gtest.h>

#include <chrono>
#include <map>

#include "cli_util.h"
#include "dtrain/nn/models.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/peak.h"
#include "dtrain/tensor/random.h"

namespace dtrain {
namespace {

// Keeps the CPU busy for `ms` of wall time (a stand-in for an op's work).
void spin(double ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double, std::milli>(ms);
  volatile double x = 0;
  while (std::chrono::steady_clock::now() < until) x = x + 1;
}

double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::map<profile::Kind, profile::Entry> by_kind() {
  std::map<profile::Kind, profile::Entry> out;
  for (const profile::Entry& e : profile::snapshot()) out[e.kind] = e;
  return out;
}

class ProfileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    profile::reset();
    profile::set_enabled(true);
  }
  void TearDown() override {
    profile::set_enabled(false);
    profile::reset();
  }
};

TEST_F(ProfileTest, NestedScopesChargeExclusiveTimeToTheirKindAndPhase) {
  const auto t0 = std::chrono::steady_clock::now();
  {
    profile::Scope outer(profile::Kind::layer_norm);
    spin(20);
    {
      profile::Scope inner(profile::Kind::matmul);
      spin(30);
    }
    {
      profile::BackwardPhase backward;
      profile::Scope inner(profile::Kind::gelu);
      spin(10);
    }
  }
  const double wall = seconds(t0);
  auto k = by_kind();
  // The outer kind is charged only while no inner scope runs.
  EXPECT_GE(k[profile::Kind::layer_norm].forward_s, 0.020);
  EXPECT_LT(k[profile::Kind::layer_norm].forward_s, 0.020 + 0.5 * 0.030);
  EXPECT_GE(k[profile::Kind::matmul].forward_s, 0.030);
  EXPECT_EQ(k[profile::Kind::matmul].backward_s, 0.0);
  EXPECT_GE(k[profile::Kind::gelu].backward_s, 0.010);
  EXPECT_EQ(k[profile::Kind::gelu].forward_s, 0.0);
  EXPECT_EQ(k[profile::Kind::layer_norm].calls, 1);
  EXPECT_EQ(k[profile::Kind::matmul].calls, 1);
  double charged = 0;
  for (const auto& [kind, e] : k) charged += e.total_s();
  EXPECT_LE(charged, wall + 1e-6) << "exclusive times add up to more than the wall time";
}

TEST_F(ProfileTest, NothingIsChargedWhileDisabled) {
  profile::set_enabled(false);
  {
    profile::Scope s(profile::Kind::optimizer);
    spin(2);
  }
  for (const profile::Entry& e : profile::snapshot()) {
    EXPECT_EQ(e.calls, 0) << profile::kind_name(e.kind);
    EXPECT_EQ(e.total_s(), 0.0) << profile::kind_name(e.kind);
  }
}

// A GPT's forward and backward: every op kind it runs is charged, products to matmul (also the
// attention's), and the kinds add up to no more than the step took.
TEST_F(ProfileTest, AGptStepIsChargedToItsOpKinds) {
  nn::GptConfig cfg;
  cfg.layers = 2;
  cfg.heads = 2;
  cfg.width = 32;
  cfg.seq_len = 16;
  cfg.vocab = 64;
  nn::Gpt model(cfg, 5);
  Generator gen(1);
  std::vector<float> ids(4 * 16), next(4 * 16);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<float>(gen.next_u64() % 64);
    next[i] = static_cast<float>(gen.next_u64() % 64);
  }
  profile::reset();
  const auto t0 = std::chrono::steady_clock::now();
  Tensor loss = model.loss(model.forward(Tensor::from_vector({4, 16}, ids)), Tensor::from_vector({4, 16}, next));
  loss.backward();
  const double wall = seconds(t0);
  auto k = by_kind();
  for (profile::Kind kind :
       {profile::Kind::matmul, profile::Kind::linear, profile::Kind::layer_norm, profile::Kind::gelu,
        profile::Kind::attention, profile::Kind::cross_entropy, profile::Kind::embedding, profile::Kind::elementwise}) {
    EXPECT_GT(k[kind].forward_s, 0.0) << profile::kind_name(kind);
    EXPECT_GT(k[kind].backward_s, 0.0) << profile::kind_name(kind);
  }
  // 4 linears per block and the head, forward; on the library's route the attention's 2 per
  // (b, h) forward too (on dtrain's own kernels they are charged to the attention, fused with it).
  EXPECT_GE(k[profile::Kind::matmul].calls, 2 * 4 + 1 + (ops::attention_f32_kernel() ? 0 : 2 * 4 * 2 * 2));
  EXPECT_GT(k[profile::Kind::grad_accumulate].calls, 0);
  double charged = 0;
  for (const auto& [kind, e] : k) charged += e.total_s();
  EXPECT_LE(charged, wall + 1e-6);
}

}  // namespace
}  // namespace dtrain

namespace {

class ProfileCli : public CliTest {};

// `dtrain train --profile` prints the table and records it; the final record has the MFU
// against the measured peak.
TEST_F(ProfileCli, TrainPrintsTimePerOpKindAndRecordsMfuAgainstTheMeasuredPeak) {
  std::string text;
  for (int i = 0; i < 300; ++i) text += "a small corpus of words that repeat " + std::to_string(i % 5) + "\n";
  write("corpus.txt", text);
  ProcessResult r = dtrain("train --model gpt --data text:" + path("corpus.txt") +
                           " --layers 2 --heads 2 --width 32 --seq-len 32 --batch-size 8 --steps 6 --eval-batches 1"
                           " --progress=false --profile --metrics " +
                           path("m.jsonl"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("profile of rank 0 over 6 steps"), std::string::npos) << r.output;
  for (const char* row : {"matmul", "layer_norm", "gelu", "attention", "cross_entropy", "embedding", "optimizer",
                          "grad_zero", "grad_accumulate", "data", "other"}) {
    EXPECT_NE(r.output.find(std::string("\n  ") + row + " "), std::string::npos) << row << "\n" << r.output;
  }
  const nlohmann::json f = final_record("m.jsonl");
  ASSERT_TRUE(f.contains("profile")) << f.dump();
  const nlohmann::json& kinds = f["profile"]["kinds"];
  EXPECT_GT(kinds["matmul"]["forward_s"].get<double>(), 0.0);
  EXPECT_GT(kinds["matmul"]["backward_s"].get<double>(), 0.0);
  EXPECT_GT(kinds["optimizer"]["forward_s"].get<double>(), 0.0);
  // The kinds are charged inside the steps only, so they fit in the train time; "other" is the rest.
  double charged = 0;
  for (const auto& [name, e] : kinds.items()) charged += e["forward_s"].get<double>() + e["backward_s"].get<double>();
  const double train = f["train_time_s"].get<double>();
  EXPECT_LE(charged, train * (1 + 1e-9));
  EXPECT_NEAR(f["profile"]["other_s"].get<double>(), train - charged, 1e-9 + 1e-9 * train);
  // MFU: the model's FLOP rate over the probe's peak, a fraction.
  const double peak = f["peak_flops_per_rank"].get<double>();
  EXPECT_GT(peak, 1e8);
  EXPECT_EQ(f["peak_isa"].get<std::string>(), dtrain::peak_probe_isa(dtrain::Precision::f32));
  EXPECT_NEAR(f["mfu"].get<double>(), f["model_flops_per_s"].get<double>() / peak, 1e-9);
  EXPECT_GT(f["mfu"].get<double>(), 0.0);
  EXPECT_LT(f["mfu"].get<double>(), 1.0);

  ProcessResult plain =
      dtrain("train --model mlp --hidden 16 --batch-size 32 --steps 3 --progress=false --metrics " + path("p.jsonl"));
  ASSERT_EQ(plain.code, 0) << plain.output;
  EXPECT_EQ(plain.output.find("profile of rank"), std::string::npos) << plain.output;
  EXPECT_FALSE(final_record("p.jsonl").contains("profile"));
}

}  // namespace
