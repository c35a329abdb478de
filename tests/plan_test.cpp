// dtrain plan's cost model: the all-reduce formulas of BENCHMARKS.md, the pipeline bubble the
// step simulator produces against (p-1)/(m+p-1), overlap of gradient buckets with backward, cores
// shared by more ranks than they are, ZeRO's memory, the memory limit and the recommendation of
// the layout search, the model shapes against nn::Mlp / nn::Gpt and dtrain's allocator, the
// calibration file, and errors for impossible layouts.
#include "dtrain/plan/plan.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/data/data.h"
#include "dtrain/plan/calibrate.h"
#include "dtrain/train/trainer.h"

namespace dtrain::plan {
namespace {

// Shared memory as dtrain measures it: every byte costs a core (copy, reduction), no wire.
LinkCost cpu_link(double alpha, double beta, double gamma) { return LinkCost{alpha, 0.0, beta, gamma, 0.0, false}; }

TEST(PlanCost, RingAllReduceIsTheBenchmarksFormula) {
  const double a = 3e-6, b = 0.5e-9, g = 0.2e-9;
  for (int p : {2, 3, 4, 8}) {
    for (double n : {8.0, 65536.0, 25.0 * (1 << 20)}) {
      const double expect = 2 * (p - 1) * a + 2 * n * (p - 1) / p * b + n * (p - 1) / p * g;
      EXPECT_NEAR(all_reduce_cost(comm::Algorithm::ring, n, p, cpu_link(a, b, g)).seconds(), expect, 1e-12 * expect)
          << p << " ranks, " << n << " bytes";
      const double hd = 2 * std::ceil(std::log2(p)) * a + 2 * n * (p - 1) / p * b + n * (p - 1) / p * g;
      EXPECT_NEAR(all_reduce_cost(comm::Algorithm::halving_doubling, n, p, cpu_link(a, b, g)).seconds(), hd,
                  1e-12 * hd);
    }
  }
  // On a network link the bytes occupy the wire; the reduction overlaps it on the cores.
  const LinkCost wire{a, b, 0.0, 0.0, 0.0, false};
  EXPECT_NEAR(all_reduce_cost(comm::Algorithm::ring, 1e6, 4, wire).seconds(), 6 * a + 2e6 * 3 / 4 * b, 1e-15);
  EXPECT_EQ(all_reduce_cost(comm::Algorithm::ring, 1e6, 1, wire).seconds(), 0.0);
  EXPECT_EQ(all_reduce_cost(comm::Algorithm::ring, 0, 4, wire).seconds(), 0.0);
  EXPECT_NEAR(reduce_scatter_cost(1e6, 4, wire).seconds() + all_gather_cost(1e6, 4, wire).seconds(),
              all_reduce_cost(comm::Algorithm::ring, 1e6, 4, wire).seconds(), 1e-15);
  // A library that picks the cheapest algorithm takes halving-doubling's lg(p) latency at scale.
  LinkCost cheap = wire;
  cheap.cheapest = true;
  EXPECT_EQ(all_reduce_algorithm(1e6, 1024, cheap), comm::Algorithm::halving_doubling);
  EXPECT_LT(all_reduce_cost(comm::Algorithm::automatic, 1e6, 1024, cheap).seconds(),
            all_reduce_cost(comm::Algorithm::ring, 1e6, 1024, cheap).seconds() / 5);
}

SimConfig balanced_pipeline(int p, int m, parallel::Schedule schedule) {
  SimConfig c;
  c.micro_batches = m;
  c.schedule = schedule;
  for (int s = 0; s < p; ++s) {
    SimStage st;
    st.forward = 1.0;
    st.backward = 2.0;
    c.stages.push_back(st);
  }
  return c;
}

TEST(PlanSimulate, BubbleOfBalancedStagesIsPMinusOneOverMPlusPMinusOne) {
  for (parallel::Schedule sched : {parallel::Schedule::gpipe, parallel::Schedule::one_f_one_b}) {
    for (auto [p, m] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {2, 8}, {3, 5}, {4, 8}, {8, 4}, {8, 32}}) {
      const SimResult r = simulate_step(balanced_pipeline(p, m, sched));
      const double theory = static_cast<double>(p - 1) / (m + p - 1);
      EXPECT_NEAR(r.step_s, (m + p - 1) * 3.0, 1e-9) << p << " stages, " << m << " micro-batches";
      for (int s = 0; s < p; ++s) {
        const SimStageResult& st = r.stages[static_cast<size_t>(s)];
        EXPECT_NEAR(1.0 - st.busy_s / r.step_s, theory, 1e-9)
            << parallel::schedule_name(sched) << ", stage " << s << " of " << p << ", " << m << " micro-batches";
        // A stage waits for its neighbours except while it computes; it ends when its last backward does.
        EXPECT_NEAR(st.pipeline_wait_s, st.end_s - m * 3.0, 1e-9);
      }
    }
  }
}

TEST(PlanSimulate, TransfersAndCoresShapeTheStep) {
  // A transfer between stages delays the pipeline by its latency in both directions per
  // fill and drain: with one micro-batch, F0 + x + F1 + B1 + x + B0.
  SimConfig c = balanced_pipeline(2, 1, parallel::Schedule::one_f_one_b);
  c.stages[0].send_forward = Cost{0.25, 0.0, 0.0};
  c.stages[1].send_backward = Cost{0.25, 0.0, 0.0};
  EXPECT_NEAR(simulate_step(c).step_s, 6.5, 1e-9);
  // Four ranks that want one core each on two cores run at half speed: F + B takes twice as long.
  SimConfig shared = balanced_pipeline(1, 1, parallel::Schedule::one_f_one_b);
  shared.stages[0].demand = 4;
  shared.cores = 2;
  EXPECT_NEAR(simulate_step(shared).step_s, 6.0, 1e-9);
  shared.cores = 4;
  EXPECT_NEAR(simulate_step(shared).step_s, 3.0, 1e-9);
}

TEST(PlanSimulate, GradientBucketsOverlapTheLastBackward) {
  // Backward in two parts of 1 s each; bucket 0 (after part 0) and bucket 1 (after part 1).
  SimConfig c = balanced_pipeline(1, 1, parallel::Schedule::one_f_one_b);
  SimStage& st = c.stages[0];
  st.backward_parts = {0.5, 0.5};
  st.ready_after = {0, 1};
  // Bucket 0 hides behind part 1; bucket 1 runs after backward: 0.5 s exposed.
  st.buckets = {Cost{0.0, 0.8, 0.0}, Cost{0.0, 0.5, 0.0}};
  SimResult r = simulate_step(c);
  EXPECT_NEAR(r.step_s, 3.5, 1e-9);
  EXPECT_NEAR(r.stages[0].dp_wait_s, 0.5, 1e-9);
  // Bucket 0 longer than part 1: bucket 1 queues behind it (1.5 + 0.5 after backward's middle).
  st.buckets[0] = Cost{0.0, 1.5, 0.0};
  r = simulate_step(c);
  EXPECT_NEAR(r.step_s, 1.0 + 1.0 + 1.5 + 0.5, 1e-9);
  EXPECT_NEAR(r.stages[0].dp_wait_s, 1.0, 1e-9);
}

TEST(PlanSimulate, FlowsOnOneHostLinkShareIt) {
  // Two stages, one micro-batch: stage 1 ends its backward at 4 s, stage 0 at 6 s; each then
  // sends a 4 s bucket. On different hosts' links they do not meet: 8 s and 10 s.
  SimConfig c = balanced_pipeline(2, 1, parallel::Schedule::one_f_one_b);
  for (SimStage& st : c.stages) {
    st.buckets = {Cost{0.0, 4.0, 0.0}};
    st.ready_after = {0};
  }
  c.stages[0].dp_flows = {1, 0};
  c.stages[1].dp_flows = {0, 1};
  SimResult r = simulate_step(c);
  EXPECT_NEAR(r.stages[1].end_s, 8.0, 1e-9);
  EXPECT_NEAR(r.step_s, 10.0, 1e-9);
  // On one host's link: stage 1 alone for 2 s, then both at half speed until stage 1 is done at
  // 10 s, then stage 0 alone for its last 2 s.
  c.stages[1].dp_flows = {1, 0};
  r = simulate_step(c);
  EXPECT_NEAR(r.stages[1].end_s, 10.0, 1e-9);
  EXPECT_NEAR(r.step_s, 12.0, 1e-9);
  // Two flows of one stage (two shards) on one link: twice the wire time.
  SimConfig one = balanced_pipeline(1, 1, parallel::Schedule::one_f_one_b);
  one.stages[0].buckets = {Cost{0.0, 1.0, 0.0}};
  one.stages[0].ready_after = {0};
  one.stages[0].dp_flows = {2};
  EXPECT_NEAR(simulate_step(one).step_s, 3.0 + 2.0, 1e-9);
}

Hardware device(double flops) {
  Hardware hw;
  hw.device_flops = flops;
  hw.intra = LinkCost{2e-6, 8.0 / 7200e9, 0.0, 0.0, 0.0, false, true};
  hw.inter = LinkCost{5e-6, 8.0 / 400e9, 0.0, 0.0, 0.0, false, true};
  hw.optimizer_s_per_param = 1e-11;
  return hw;
}

TEST(PlanMemory, ZeroShardsOptimizerStateThenGradientsOverDataParallelRanks) {
  const ModelSpec m = gpt_by_params(1.3e9, 2048, 50304);
  Layout l;
  l.dp = 4;
  const Prediction base = predict(m, device(1e15), l, 64);
  const double n = static_cast<double>(m.params());
  EXPECT_DOUBLE_EQ(base.memory.params, 2 * n);
  EXPECT_DOUBLE_EQ(base.memory.grads, 2 * n);
  EXPECT_DOUBLE_EQ(base.memory.optimizer, 12 * n);  // f32 master weights and two moments
  l.zero = 1;
  const Prediction z1 = predict(m, device(1e15), l, 64);
  EXPECT_DOUBLE_EQ(z1.memory.optimizer, base.memory.optimizer / 4);
  EXPECT_DOUBLE_EQ(z1.memory.grads, base.memory.grads);
  l.zero = 2;
  const Prediction z2 = predict(m, device(1e15), l, 64);
  EXPECT_DOUBLE_EQ(z2.memory.optimizer, base.memory.optimizer / 4);
  EXPECT_DOUBLE_EQ(z2.memory.grads, base.memory.grads / 4);
  EXPECT_DOUBLE_EQ(z2.memory.activations, base.memory.activations);
  // ZeRO 3: the parameters too, plus the two largest neighbouring blocks gathered while they run
  // (here the 50304 x 2048 embedding, 8% of the model, and a 50M-parameter transformer block).
  l.zero = 3;
  const Prediction z3 = predict(m, device(1e15), l, 64);
  EXPECT_DOUBLE_EQ(z3.memory.optimizer, base.memory.optimizer / 4);
  EXPECT_DOUBLE_EQ(z3.memory.grads, base.memory.grads / 4);
  EXPECT_GT(z3.memory.params, base.memory.params / 4);
  EXPECT_LT(z3.memory.params, base.memory.params * (0.25 + 0.15));
  // 1f1b keeps at most p - s micro-batches in flight, gpipe all of them.
  Layout pipe;
  pipe.pp = 4;
  pipe.micro_batches = 16;
  const Prediction one = predict(m, device(1e15), pipe, 64);
  pipe.schedule = parallel::Schedule::gpipe;
  const Prediction all = predict(m, device(1e15), pipe, 64);
  EXPECT_EQ(one.stages[0].in_flight, 4);
  EXPECT_EQ(one.stages[3].in_flight, 1);
  EXPECT_EQ(all.stages[0].in_flight, 16);
  EXPECT_GT(all.memory.activations, 3 * one.memory.activations);
}

TEST(PlanMemory, Int8OptimizerStateIsAByteAPerMomentAndAScalePer256) {
  const ModelSpec m = gpt_spec(4, 128, 4, 128);  // f32: no master copy
  Layout l;
  const Prediction f32 = predict(m, device(1e12), l, 16);
  const double n = static_cast<double>(m.params());
  EXPECT_DOUBLE_EQ(f32.memory.optimizer, 8 * n);
  l.optimizer_state = "int8";
  const Prediction q8 = predict(m, device(1e12), l, 16);
  EXPECT_DOUBLE_EQ(q8.memory.optimizer, 2 * n * (1 + 4.0 / 256));
  EXPECT_GE(f32.memory.optimizer / q8.memory.optimizer, 3.9);
  EXPECT_NE(q8.layout.str().find("int8 optimizer state"), std::string::npos);
  l.dp = 2;
  l.zero = 1;
  try {
    check_layout(m, l, 16);
    ADD_FAILURE() << "int8 state with --zero 1 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer state 'int8' with adamw and --zero 1"), std::string::npos)
        << e.what();
  }
}

TEST(PlanSearch, MemoryLimitExcludesLayoutsAndTheCheapestFeasibleIsRecommended) {
  const ModelSpec m = gpt_by_params(7e9, 2048, 50304);
  Hardware hw = device(9.9e14);
  SearchOptions o;
  o.devices = 16;
  // No limit: pure data parallelism of a 7B model (about 110 GB of state per device) is allowed.
  const SearchResult free = search(m, hw, 64, Layout{}, o);
  ASSERT_FALSE(free.ranked.empty());
  EXPECT_EQ(free.too_big, 0);
  hw.memory = 80e9;
  const SearchResult r = search(m, hw, 64, Layout{}, o);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_GT(r.too_big, 0);
  for (const Prediction& p : r.ranked) {
    EXPECT_LE(p.memory.total(), 80e9) << p.layout.str();
    EXPECT_FALSE(p.layout.dp == 16 && p.layout.zero == 0 && !p.layout.recompute) << p.layout.str();
  }
  // The recommendation is the fastest of every feasible layout, each predicted on its own here.
  double best = std::numeric_limits<double>::infinity();
  for (int tp : {1, 2, 4, 8, 16}) {
    for (int pp : {1, 2, 4, 8, 16}) {
      if (tp * pp > 16) continue;
      for (int zero : {0, 1, 2, 3}) {
        for (int64_t mb : {1, 2, 4, 8, 16, 32, 64}) {
          for (bool rc : {false, true}) {
            Layout l;
            l.tp = tp;
            l.pp = pp;
            l.dp = 16 / tp / pp;
            l.zero = zero;
            l.recompute = rc;
            (pp > 1 ? l.micro_batches : l.accumulate) = mb;
            try {
              check_layout(m, l, 64);
            } catch (const Error&) {
              continue;
            }
            const Prediction p = predict(m, hw, l, 64);
            if (p.fits) best = std::min(best, p.step_s);
          }
        }
      }
    }
  }
  EXPECT_NEAR(r.ranked.front().step_s, best, 1e-12);
  for (size_t i = 1; i < r.ranked.size(); ++i) EXPECT_GE(r.ranked[i].step_s, r.ranked[i - 1].step_s * (1 - 1e-3));
}

// The search tries ZeRO 3 too: under a limit that pure data parallelism with ZeRO 2 exceeds, the
// same four replicas with sharded parameters fit and are among the feasible layouts.
TEST(PlanSearch, ZeroThreeIsTriedAndFitsWhereZeroTwoDoesNot) {
  const ModelSpec m = gpt_spec(16, 512, 8, 128);
  Layout z2;
  z2.dp = 4;
  z2.zero = 2;
  Layout z3 = z2;
  z3.zero = 3;
  const Prediction p2 = predict(m, device(1e12), z2, 16);
  const Prediction p3 = predict(m, device(1e12), z3, 16);
  ASSERT_LT(p3.memory.total(), p2.memory.total());
  Hardware hw = device(1e12);
  hw.memory = (p2.memory.total() + p3.memory.total()) / 2;
  SearchOptions o;
  o.devices = 4;
  const SearchResult r = search(m, hw, 16, Layout{}, o);
  bool zero3 = false;
  for (const Prediction& p : r.ranked) {
    EXPECT_FALSE(p.layout.dp == 4 && p.layout.zero == 2 && !p.layout.recompute && p.layout.accumulate == 1)
        << p.layout.str();
    zero3 = zero3 || (p.layout.dp == 4 && p.layout.zero == 3);
  }
  EXPECT_TRUE(zero3) << "no --dp 4 --zero 3 layout among " << r.ranked.size() << " feasible ones";
}

TEST(PlanLayout, ImpossibleLayoutsAreClearErrors) {
  const ModelSpec gpt = gpt_spec(4, 128, 4, 64);
  const ModelSpec mlp = mlp_spec(784, {64}, 10);
  auto message = [](const ModelSpec& m, Layout l, int64_t batch) -> std::string {
    try {
      check_layout(m, l, batch);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  Layout l;
  l.tp = 3;
  EXPECT_NE(message(gpt, l, 16).find("--heads 4 is not divisible by --tp 3"), std::string::npos) << message(gpt, l, 16);
  l = Layout{};
  l.tp = 2;
  EXPECT_NE(message(mlp, l, 16).find("tensor parallelism"), std::string::npos);
  l = Layout{};
  l.pp = 7;
  EXPECT_NE(message(gpt, l, 16).find("--pp 7 stages but the gpt model has only 6 blocks"), std::string::npos);
  l = Layout{};
  l.dp = 3;
  EXPECT_NE(message(gpt, l, 16).find("--batch-size 16 is not divisible by --dp 3"), std::string::npos);
  l = Layout{};
  l.zero = 1;
  EXPECT_NE(message(gpt, l, 16).find("--zero 1"), std::string::npos);
  l = Layout{};
  l.micro_batches = 4;
  EXPECT_NE(message(gpt, l, 16).find("needs pipeline stages"), std::string::npos);
  EXPECT_THROW(gpt_spec(4, 130, 4, 64), Error);                 // width not divisible by heads
  EXPECT_THROW(predict(gpt, Hardware{}, Layout{}, 16), Error);  // no compute rate
  SearchOptions o;
  o.devices = 0;
  EXPECT_THROW(search(gpt, device(1e12), 16, Layout{}, o), Error);
}

TEST(PlanModel, ShapesAreThoseOfDtrainsModels) {
  const nn::Gpt gpt(nn::GptConfig{256, 64, 3, 4, 96, 0.0f}, 1);
  const ModelSpec g = gpt_spec(3, 96, 4, 64);
  ASSERT_EQ(g.blocks.size(), gpt.block_flops().size());
  for (size_t i = 0; i < g.blocks.size(); ++i) {
    EXPECT_NEAR(g.blocks[i].flops, gpt.block_flops()[i] * 64, 1e-6 * g.blocks[i].flops) << i;
    EXPECT_EQ(g.blocks[i].params, gpt.block_params()[i]) << i;
  }
  EXPECT_EQ(g.params(), gpt.num_parameters());
  const nn::Mlp mlp(784, {100, 50}, 10, 1);
  const ModelSpec m = mlp_spec(784, {100, 50}, 10);
  EXPECT_EQ(m.params(), mlp.num_parameters());
  EXPECT_EQ(m.block_flops(), mlp.block_flops());
  // Published shapes by parameter count.
  const ModelSpec g7 = gpt_by_params(7e9, 2048, 50304);
  EXPECT_EQ(g7.blocks.size(), 34u);  // 32 layers
  EXPECT_EQ(g7.width, 4096);
  EXPECT_NEAR(static_cast<double>(g7.params()), 6.86e9, 0.01e9);
}

TEST(PlanModel, ActivationBytesAreWhatTheAllocatorHolds) {
  train::TrainConfig cfg;
  cfg.model = "gpt";
  cfg.layers = 2;
  cfg.width = 64;
  cfg.heads = 4;
  cfg.seq_len = 32;
  const ModelSpec spec = model_of(cfg);
  for (int tp : {1, 2}) {
    const KernelEntry e = measure_kernels(cfg, 3, tp, 1);
    ASSERT_EQ(e.act_bytes.size(), spec.blocks.size());
    for (size_t i = 0; i < spec.blocks.size(); ++i) {
      const BlockSpec& b = spec.blocks[i];
      const double predicted = 3 * (b.act_bytes + b.tp_act_bytes / tp);
      EXPECT_NEAR(e.act_bytes[i], predicted, 0.02 * predicted) << b.name << " tp " << tp;
    }
  }
  cfg.model = "mlp";
  cfg.hidden = {64, 32};
  const ModelSpec mspec = model_of(cfg);
  const KernelEntry e = measure_kernels(cfg, 5, 1, 1);
  for (size_t i = 0; i < mspec.blocks.size(); ++i) {
    EXPECT_NEAR(e.act_bytes[i], 5 * mspec.blocks[i].act_bytes, 0.02 * 5 * mspec.blocks[i].act_bytes) << i;
  }
}

TEST(PlanCalibration, RoundTripsAndRejectsOtherFiles) {
  Calibration c;
  c.cores = 2;
  c.shm = {1e-6, 1e-10};
  c.tcp = {2e-5, 6e-10};
  c.flops_per_s = 3e10;
  c.optimizer_s_per_param = 1e-9;
  KernelEntry e;
  e.model = "{\"model\":\"mlp\"}";
  e.rows = 8;
  e.times.forward = {1e-3, 2e-3};
  e.times.backward = {2e-3, 4e-3};
  c.put(e);
  e.times.forward = {5e-3, 6e-3};
  c.put(e);  // replaces the entry of the same key
  const Calibration back = calibration_from_json(to_json(c), "test");
  ASSERT_EQ(back.kernels.size(), 1u);
  ASSERT_NE(back.find(e.model, 8, 1, 1, 1), nullptr);
  EXPECT_EQ(back.find(e.model, 8, 1, 1, 1)->times.forward, e.times.forward);
  EXPECT_EQ(back.find(e.model, 4, 1, 1, 1), nullptr);
  EXPECT_DOUBLE_EQ(back.tcp.alpha_s, 2e-5);
  nlohmann::json j = to_json(c);
  j["version"] = 99;
  EXPECT_THROW(calibration_from_json(j, "test"), Error);
  EXPECT_THROW(calibration_from_json(nlohmann::json{{"format", "other"}}, "test"), Error);
}

}  // namespace
}  // namespace dtrain::plan
