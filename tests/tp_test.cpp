// Tensor parallelism with ranks as threads over the real shm transport: the f / g ops on exactly
// verifiable values, the shard layout and its round trip, a tensor-parallel block and a whole
// GPT against the single-process run of the same batch (forward, gradients, SGD steps), a
// pipeline stage holding only some blocks, and the divisibility errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm_test_util.h"
#include "dtrain/comm/group.h"
#include "dtrain/core/error.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/models.h"
#include "dtrain/optim/optim.h"
#include "dtrain/parallel/tensor_parallel.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/random.h"

namespace dtrain::parallel {
namespace {

void run_ranks(int size, const std::function<void(comm::Group&)>& fn) {
  comm::test_util::run_ranks(size, fn, comm::test_util::quick_options());
}

// max |a - ref| / max |ref|: relative to the tensor's magnitude, not per element.
double max_rel(const std::vector<float>& a, const std::vector<float>& ref) {
  EXPECT_EQ(a.size(), ref.size());
  double diff = 0, mag = 0;
  for (size_t i = 0; i < std::min(a.size(), ref.size()); ++i) {
    diff = std::max(diff, static_cast<double>(std::fabs(a[i] - ref[i])));
    mag = std::max(mag, static_cast<double>(std::fabs(ref[i])));
  }
  return mag > 0 ? diff / mag : diff;
}

// The largest error seen per quantity, printed at the end of each test that records any.
struct Worst {
  std::mutex mu;
  std::map<std::string, double> err;
  void note(const std::string& what, double e) {
    std::lock_guard<std::mutex> lock(mu);
    err[what] = std::max(err[what], e);
  }
  void print(const char* test) {
    for (const auto& [what, e] : err) std::printf("[ tp ] %s: max relative error %-14s %.3e\n", test, what.c_str(), e);
  }
};

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

nn::GptConfig small_config(float dropout = 0.0f) {
  return {.vocab = 256, .seq_len = 16, .layers = 2, .heads = 4, .width = 32, .dropout = dropout};
}

// ---- tp_copy / tp_reduce on exactly representable values ----

TEST(TensorParallel, CopyAndReduceSumExactlyInTheirDirection) {
  for (int world : {1, 2, 4}) {
    run_ranks(world, [&](comm::Group& g) {
      const float r = static_cast<float>(g.rank() + 1);
      const float total = static_cast<float>(world * (world + 1) / 2);
      // tp_reduce: forward sums the ranks' values; backward passes the gradient through.
      Tensor x = Tensor::full({2, 3}, r).set_requires_grad(true);
      Tensor y = tp_reduce(x, g);
      EXPECT_FALSE(y.same(x));
      for (float v : y.to_vector()) EXPECT_EQ(v, total);
      EXPECT_EQ(x.to_vector()[0], r) << "tp_reduce must not write its input";
      ops::sum(ops::mul_scalar(y, r)).backward();
      for (float v : x.grad().to_vector()) EXPECT_EQ(v, r);
      // tp_copy: forward the identity; backward sums the ranks' gradients.
      Tensor a = Tensor::full({5}, 1.0f).set_requires_grad(true);
      Tensor b = tp_copy(a, g);
      EXPECT_EQ(b.to_vector(), a.to_vector());
      ops::sum(ops::mul_scalar(b, r)).backward();
      for (float v : a.grad().to_vector()) EXPECT_EQ(v, total);
    });
  }
}

// ---- shard layout ----

TEST(TensorParallel, ShardPiecesFollowTheGroupsRanksPiecesLayout) {
  // qkv-like (12, 2), groups 3, 2 ranks: dimension 0 is (3 groups, 2 ranks, 2 rows), so rank 1
  // holds rows 2-3 (its q), 6-7 (its k) and 10-11 (its v).
  std::vector<float> v;
  for (int i = 0; i < 12; ++i) {
    for (int j = 0; j < 2; ++j) v.push_back(static_cast<float>(i * 100 + j));
  }
  Tensor full = Tensor::from_vector({12, 2}, v);
  Tensor piece = shard_tensor(full, {0, 3}, 1, 2);
  ASSERT_EQ(piece.shape(), (Shape{6, 2}));
  EXPECT_EQ(piece.to_vector(), (std::vector<float>{200, 201, 300, 301, 600, 601, 700, 701, 1000, 1001, 1100, 1101}));
  // Columns (dim 1) of a (2, 4) over 2 ranks: rank 0 holds columns 0-1.
  Tensor cols = shard_tensor(Tensor::from_vector({2, 4}, {0, 1, 2, 3, 10, 11, 12, 13}), {1, 1}, 0, 2);
  EXPECT_EQ(cols.to_vector(), (std::vector<float>{0, 1, 10, 11}));
  // Replicated: a copy, not a view.
  Tensor copy = shard_tensor(full, {}, 0, 2);
  EXPECT_EQ(copy.to_vector(), v);
  EXPECT_NE(copy.impl()->storage, full.impl()->storage);
  // A split that does not divide names the sizes.
  try {
    shard_tensor(full, {0, 3}, 0, 5);
    FAIL() << "12 rows split in 3 groups x 5 ranks must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("3 groups x 5 ranks"), std::string::npos) << e.what();
  }
}

TEST(TensorParallel, ShardThenGatherGivesBackTheFullTensor) {
  Generator gen(5);
  // Each size divides 3 groups x 4 ranks along the split dimension; (2, 24, 3) has outer and inner blocks.
  const std::vector<Tensor> fulls = {Tensor::randn({24, 12}, gen), Tensor::randn({24}, gen),
                                     Tensor::randn({2, 24, 3}, gen)};
  struct Case {
    size_t tensor;
    ShardSpec spec;
  };
  const std::vector<Case> cases = {{0, {0, 1}}, {0, {1, 1}}, {0, {0, 3}}, {0, {1, 3}}, {1, {0, 1}},
                                   {1, {0, 3}}, {2, {1, 1}}, {2, {1, 3}}, {0, {-1, 1}}};
  for (int world : {1, 2, 4}) {
    run_ranks(world, [&](comm::Group& g) {
      for (const Case& c : cases) {
        const Tensor& full = fulls[c.tensor];
        Tensor piece = shard_tensor(full, c.spec, g.rank(), world);
        Shape expected = full.shape();
        if (c.spec.dim >= 0) expected[static_cast<size_t>(c.spec.dim)] /= world;
        EXPECT_EQ(piece.shape(), expected);
        Tensor back = gather_shards(piece, c.spec, g);
        EXPECT_TRUE(bitwise_equal(back.to_vector(), full.to_vector()))
            << "world " << world << " tensor " << c.tensor << " dim " << c.spec.dim << " groups " << c.spec.groups;
      }
    });
  }
}

// ---- one block against nn::TransformerBlock ----

struct BlockRun {
  std::vector<float> out, x_grad;
  std::map<std::string, std::vector<float>> grads;
  std::vector<std::string> names;
};

std::shared_ptr<nn::Sequential> make_block(const nn::GptConfig& cfg, uint64_t seed) {
  Generator gen(seed);
  auto seq = std::make_shared<nn::Sequential>();
  seq->add("h0", std::make_shared<nn::TransformerBlock>(cfg, 0, gen));
  return seq;
}

// Forward x (B, S, C), then backward of sum(out * weights); tp gathers the parameter gradients.
BlockRun run_block(nn::Sequential& seq, const Tensor& x_in, const Tensor& weights, comm::Group* tp,
                   const std::map<std::string, ShardSpec>& specs) {
  BlockRun r;
  Tensor x = x_in.clone().set_requires_grad(true);
  Tensor out = seq.forward(x);
  r.out = out.to_vector();
  ops::sum(ops::mul(out, weights)).backward();
  r.x_grad = x.grad().to_vector();
  for (const auto& [name, p] : seq.named_parameters()) {
    r.names.push_back(name);
    r.grads[name] = tp != nullptr ? gather_shards(p.grad(), specs.at(name), *tp).to_vector() : p.grad().to_vector();
  }
  return r;
}

void check_block(float dropout, const char* label) {
  const nn::GptConfig cfg = small_config(dropout);
  const uint64_t seed = 11;
  Generator data_gen(3);
  const Tensor x = Tensor::randn({2, cfg.seq_len, cfg.width}, data_gen);
  const Tensor weights = Tensor::randn({2, cfg.seq_len, cfg.width}, data_gen);
  auto full = make_block(cfg, seed);
  const BlockRun ref = run_block(*full, x, weights, nullptr, {});
  const int64_t full_params = full->num_parameters();
  if (dropout > 0) {  // dropout must change the output, or matching it would prove nothing
    auto eval = make_block(cfg, seed);
    eval->train(false);
    EXPECT_GT(max_rel(eval->forward(x).to_vector(), ref.out), 1e-3);  // measured 6e-3
  }

  Worst worst;
  for (int world : {1, 2, 4}) {
    run_ranks(world, [&](comm::Group& g) {
      auto seq = make_block(cfg, seed);
      const auto specs = tensor_parallelize(*seq, g, cfg.heads);
      EXPECT_EQ(std::dynamic_pointer_cast<nn::TransformerBlock>(seq->block(0)), nullptr) << "block not replaced";
      // Each rank holds 1/T of every matrix but LayerNorms and row-parallel biases (4 C each).
      const int64_t c = cfg.width, replicated = 4 * c + 2 * c;
      EXPECT_EQ(seq->num_parameters(), replicated + (full_params - replicated) / world) << "world " << world;
      EXPECT_EQ(specs.at("h0.qkv.weight").groups, 3);
      EXPECT_EQ(specs.at("h0.proj.weight").dim, 1);
      EXPECT_LT(specs.at("h0.proj.bias").dim, 0);

      const BlockRun tp = run_block(*seq, x, weights, &g, specs);
      EXPECT_EQ(tp.names, ref.names) << "parameter names or order changed";
      const double e_out = max_rel(tp.out, ref.out);
      const double e_x = max_rel(tp.x_grad, ref.x_grad);
      EXPECT_LT(e_out, 1e-5) << "world " << world;
      EXPECT_LT(e_x, 1e-5) << "world " << world;
      worst.note("output", e_out);
      worst.note("input grad", e_x);
      for (const auto& name : ref.names) {
        const double e = max_rel(tp.grads.at(name), ref.grads.at(name));
        EXPECT_LT(e, 1e-5) << name << " world " << world;
        worst.note("param grads", e);
      }
    });
  }
  worst.print(label);
}

TEST(TensorParallel, BlockMatchesTransformerBlockForwardAndBackward) { check_block(0.0f, "block"); }

// Dropout runs on the replicated region outputs with the block's own generator, so its masks
// are the single process's too.
TEST(TensorParallel, BlockWithDropoutMatchesTransformerBlock) { check_block(0.2f, "block+dropout"); }

// ---- a whole GPT: loss and three SGD steps ----

struct GptBatch {
  Tensor ids, targets;
};

GptBatch make_batch(const nn::GptConfig& cfg, int64_t batch) {
  Generator gen(17);
  std::vector<float> ids, targets;
  for (int64_t i = 0; i < batch * cfg.seq_len; ++i) {
    ids.push_back(static_cast<float>(gen.below(static_cast<uint64_t>(cfg.vocab))));
    targets.push_back(static_cast<float>(gen.below(static_cast<uint64_t>(cfg.vocab))));
  }
  return {Tensor::from_vector({batch, cfg.seq_len}, ids), Tensor::from_vector({batch, cfg.seq_len}, targets)};
}

constexpr int kSteps = 3;
constexpr float kLr = 0.5f, kMomentum = 0.9f;

// Three SGD steps on the same batch; returns the loss of each step.
std::vector<float> train_steps(nn::Gpt& model, const GptBatch& b) {
  optim::Sgd opt(model.parameters(), kLr, kMomentum);
  std::vector<float> losses;
  for (int s = 0; s < kSteps; ++s) {
    Tensor loss = model.loss(model.forward(b.ids), b.targets);
    losses.push_back(loss.item());
    loss.backward();
    opt.step();
    opt.zero_grad();
  }
  return losses;
}

std::map<std::string, std::vector<float>> values(const nn::Module& m) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, p] : m.named_parameters()) out[name] = p.to_vector();
  return out;
}

TEST(TensorParallel, GptTrainsLikeTheSingleProcessRun) {
  const nn::GptConfig cfg = small_config();
  const uint64_t seed = 23;
  const GptBatch batch = make_batch(cfg, 4);
  nn::Gpt ref_model(cfg, seed);
  const auto initial = values(ref_model);
  const std::vector<float> ref_losses = train_steps(ref_model, batch);
  const auto ref_params = values(ref_model);
  // The steps must move every parameter and the loss, or equal values would prove nothing.
  EXPECT_LT(ref_losses.back(), ref_losses.front());
  for (const auto& [name, v] : ref_params) EXPECT_GT(max_rel(v, initial.at(name)), 1e-4) << name;

  const int world = 2;
  std::vector<std::map<std::string, std::vector<float>>> replicated(world);
  Worst worst;
  run_ranks(world, [&](comm::Group& g) {
    nn::Gpt model(cfg, seed);
    const auto specs = tensor_parallelize(model, g, cfg.heads);
    EXPECT_EQ(specs.size(), model.named_parameters().size());
    EXPECT_EQ(specs.at("h1.fc.weight").dim, 0);
    EXPECT_LT(specs.at("embed.wte").dim, 0);
    EXPECT_LT(specs.at("head.lm_head.weight").dim, 0);
    EXPECT_LT(specs.at("h0.ln1.weight").dim, 0);

    const std::vector<float> losses = train_steps(model, batch);
    ASSERT_EQ(losses.size(), ref_losses.size());
    for (size_t s = 0; s < losses.size(); ++s) {
      const double e = std::fabs(losses[s] - ref_losses[s]) / std::fabs(ref_losses[s]);
      EXPECT_LT(e, 1e-5) << "step " << s;
      worst.note("loss", e);
    }
    for (const auto& [name, p] : model.named_parameters()) {
      const ShardSpec spec = specs.at(name);
      const double e = max_rel(gather_shards(p, spec, g).to_vector(), ref_params.at(name));
      EXPECT_LT(e, 1e-5) << name;
      worst.note(spec.dim < 0 ? "replicated params" : "sharded params", e);
      if (spec.dim < 0) replicated[static_cast<size_t>(g.rank())][name] = p.to_vector();
    }
  });
  ASSERT_FALSE(replicated[0].empty());
  for (int r = 1; r < world; ++r) {
    for (const auto& [name, v] : replicated[0]) {
      EXPECT_TRUE(bitwise_equal(replicated[static_cast<size_t>(r)].at(name), v)) << name << " differs on rank " << r;
    }
  }
  worst.print("gpt");
}

// A pipeline stage holding only "h1" and "head": blocks are found by type, not position.
TEST(TensorParallel, PipelineStageOfSomeBlocksMatchesTheFullStage) {
  const nn::GptConfig cfg = small_config();
  const uint64_t seed = 29;
  auto make_stage = [&] {
    auto gpt = std::make_shared<nn::Gpt>(cfg, seed);
    auto stage = std::make_shared<nn::Sequential>();
    stage->add("h1", gpt->block(2));
    stage->add("head", gpt->block(3));
    return stage;
  };
  Generator gen(31);
  const Tensor x = Tensor::randn({2, cfg.seq_len, cfg.width}, gen);
  const std::vector<float> ref = make_stage()->forward(x).to_vector();
  run_ranks(2, [&](comm::Group& g) {
    auto stage = make_stage();
    const auto specs = tensor_parallelize(*stage, g, cfg.heads);
    EXPECT_EQ(specs.at("h1.qkv.bias").groups, 3);
    EXPECT_LT(specs.at("head.ln_f.weight").dim, 0);
    EXPECT_LT(max_rel(stage->forward(x).to_vector(), ref), 1e-5);
  });
}

// ---- errors ----

// Runs tensor_parallelize on a GPT of (width, heads) over `world` ranks; expects an Error whose
// message holds each of `needles`, and the model left unchanged.
void expect_error(int world, int64_t width, int64_t heads, int64_t heads_arg, const std::vector<std::string>& needles) {
  run_ranks(world, [&](comm::Group& g) {
    nn::GptConfig cfg = small_config();
    cfg.width = width;
    cfg.heads = heads;
    nn::Gpt model(cfg, 1);
    try {
      tensor_parallelize(model, g, heads_arg);
      ADD_FAILURE() << "width " << width << " heads " << heads << " over " << world << " ranks must throw";
    } catch (const Error& e) {
      for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
    EXPECT_NE(std::dynamic_pointer_cast<nn::TransformerBlock>(model.block(1)), nullptr) << "model changed";
  });
}

TEST(TensorParallel, IndivisibleHeadsOrWidthNameBothNumbers) {
  expect_error(2, 30, 3, 3, {"3 heads", "tensor-parallel size 2"});
  expect_error(4, 6, 2, 2, {"width 6", "tensor-parallel size 4"});
  expect_error(2, 32, 4, 2, {"2 heads given", "has 4"});
}

}  // namespace
}  // namespace dtrain::parallel
