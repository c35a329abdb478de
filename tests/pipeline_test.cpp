// Pipeline parallelism: the schedules' shape (every micro-batch forward before backward, at most
// P - s micro-batches in flight with 1f1b), stage balancing and hand-written cuts, and stages as
// threads over the real shm transport computing exactly the gradients of one process that runs
// the same micro-batches (gpipe, 1f1b, recompute; 2 and 4 stages), and malformed peer messages.
#include "dtrain/parallel/pipeline.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "comm_test_util.h"
#include "dtrain/core/error.h"
#include "dtrain/parallel/mesh.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/random.h"

namespace dtrain::parallel {
namespace {

void run_ranks(int size, const std::function<void(comm::Group&)>& fn) {
  comm::test_util::run_ranks(size, fn, comm::test_util::quick_options());
}

TEST(PipelineSchedule, EveryMicroBatchRunsForwardThenBackwardAndOneFOneBBoundsWhatIsInFlight) {
  for (Schedule sched : {Schedule::gpipe, Schedule::one_f_one_b}) {
    for (int P = 1; P <= 4; ++P) {
      for (int M = 1; M <= 16; ++M) {
        for (int s = 0; s < P; ++s) {
          const auto ops = pipeline_schedule(sched, P, s, M);
          ASSERT_EQ(ops.size(), static_cast<size_t>(2 * M));
          std::set<int> fwd, bwd;
          int in_flight = 0, most = 0;
          for (const PipeOp& op : ops) {
            if (op.forward) {
              EXPECT_TRUE(fwd.insert(op.micro).second);
              ++in_flight;
            } else {
              EXPECT_TRUE(fwd.count(op.micro)) << "backward before forward";
              EXPECT_TRUE(bwd.insert(op.micro).second);
              --in_flight;
            }
            most = std::max(most, in_flight);
          }
          // Backwards in micro-batch order: gradients accumulate in the single process's order.
          int expect = 0;
          for (const PipeOp& op : ops) {
            if (!op.forward) {
              EXPECT_EQ(op.micro, expect++);
            }
          }
          EXPECT_EQ(most, sched == Schedule::gpipe ? M : std::min(P - s, M))
              << schedule_name(sched) << " P " << P << " M " << M << " stage " << s;
        }
      }
    }
  }
  EXPECT_THROW(parse_schedule("zigzag"), Error);
}

TEST(PipelineStages, BalancedCutsAndHandWrittenOnes) {
  // Equal blocks: equal stages.
  auto r = balance_stages({1, 1, 1, 1, 1, 1}, {1, 1, 1, 1, 1, 1}, 3);
  ASSERT_EQ(r.size(), 3u);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(r[s].begin, 2u * s);
    EXPECT_EQ(r[s].end, 2u * s + 2);
  }
  // A heavy first block gets a stage to itself; among equal compute, memory decides.
  r = balance_stages({6, 1, 1, 1, 1, 1, 1}, {1, 1, 1, 1, 1, 1, 1}, 2);
  EXPECT_EQ(r[0].end, 1u);
  EXPECT_EQ(balance_stages({1, 0, 1}, {1, 5, 3}, 2)[0].end, 2u);
  EXPECT_EQ(balance_stages({1, 0, 1}, {3, 5, 1}, 2)[0].end, 1u);
  try {
    balance_stages({1, 1}, {1, 1}, 3);
    FAIL() << "3 stages of 2 blocks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("only 2 blocks"), std::string::npos) << e.what();
  }
  r = parse_stages("0-2,3-3,4-5", 6, 3);
  EXPECT_EQ(r[1].begin, 3u);
  EXPECT_EQ(r[1].end, 4u);
  EXPECT_EQ(parse_stages("0,1-5", 6, 2)[0].end, 1u);
  for (const char* bad : {"0-2,4-5", "0-2,3-4", "0-5", "a-b,3-5", "0-2,,3-5", "1-2,3-5", "0--2,3-5"}) {
    EXPECT_THROW(parse_stages(bad, 6, 2), Error) << bad;
  }
}

TEST(Mesh, CoordinatesRoundTripAndAxisGroupsHaveTheRightMembers) {
  const MeshShape shape{2, 2, 2};
  for (int r = 0; r < 8; ++r) EXPECT_EQ(mesh_rank(shape, mesh_coord(shape, r)), r);
  EXPECT_EQ(mesh_coord(shape, 5).dp, 1);
  EXPECT_EQ(mesh_coord(shape, 5).pp, 0);
  EXPECT_EQ(mesh_coord(shape, 5).tp, 1);
  run_ranks(8, [&](comm::Group& g) {
    Mesh mesh(g, shape);
    const MeshCoord c = mesh.coord();
    EXPECT_EQ(mesh.dp().rank(), c.dp);
    EXPECT_EQ(mesh.pp().rank(), c.pp);
    EXPECT_EQ(mesh.tp().rank(), c.tp);
    // Summing world ranks over an axis names its members.
    int64_t v = g.rank(), sum = 0;
    mesh.dp().all_reduce(&v, &sum, 1, comm::DataType::i64, comm::ReduceOp::sum);
    EXPECT_EQ(sum, 2 * g.rank() + 4 - 8 * c.dp);  // r and r +- 4
    mesh.tp().all_reduce(&v, &sum, 1, comm::DataType::i64, comm::ReduceOp::sum);
    EXPECT_EQ(sum, 2 * (g.rank() - c.tp) + 1);
  });
  run_ranks(3, [&](comm::Group& g) {
    try {
      Mesh mesh(g, MeshShape{2, 1, 2});
      FAIL() << "a 4-rank mesh on 3 ranks";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("the world has 3"), std::string::npos) << e.what();
    }
  });
}

nn::GptConfig small_gpt() { return {.vocab = 32, .seq_len = 8, .layers = 4, .heads = 2, .width = 16}; }

constexpr int64_t kMicro = 2;  // sequences per micro-batch

std::pair<Tensor, Tensor> micro_batch(int m) {
  Generator gen(100 + static_cast<uint64_t>(m));
  const nn::GptConfig c = small_gpt();
  std::vector<float> ids, next;
  for (int64_t i = 0; i < kMicro * (c.seq_len + 1); ++i) ids.push_back(static_cast<float>(gen.next_u64() % 32));
  std::vector<float> x, y;
  for (int64_t b = 0; b < kMicro; ++b) {
    for (int64_t t = 0; t < c.seq_len; ++t) {
      x.push_back(ids[static_cast<size_t>(b * (c.seq_len + 1) + t)]);
      y.push_back(ids[static_cast<size_t>(b * (c.seq_len + 1) + t + 1)]);
    }
  }
  return {Tensor::from_vector({kMicro, c.seq_len}, x), Tensor::from_vector({kMicro, c.seq_len}, y)};
}

// One process: the whole model, the same micro-batches accumulated in order, loss / M each.
std::map<std::string, std::vector<float>> single_process_grads(int M, double* loss_sum) {
  nn::Gpt model(small_gpt(), 5);
  *loss_sum = 0.0;
  for (int m = 0; m < M; ++m) {
    auto [x, y] = micro_batch(m);
    Tensor loss = model.loss(model.forward(x), y);
    *loss_sum += loss.item();
    (loss * (1.0f / static_cast<float>(M))).backward();
  }
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, p] : model.named_parameters()) out[name] = p.grad().to_vector();
  return out;
}

TEST(Pipeline, StagesComputeExactlyTheGradientsOfOneProcessOnTheSameMicroBatches) {
  struct Case {
    int stages, micro;
    Schedule schedule;
    bool recompute;
  };
  const std::vector<Case> cases = {{2, 4, Schedule::one_f_one_b, false},
                                   {2, 4, Schedule::gpipe, false},
                                   {4, 8, Schedule::one_f_one_b, false},
                                   {4, 3, Schedule::gpipe, false},
                                   {3, 5, Schedule::one_f_one_b, true}};
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{} stages, {} micro-batches, {}{}", c.stages, c.micro, schedule_name(c.schedule),
                             c.recompute ? ", recompute" : ""));
    double ref_loss = 0.0;
    const auto ref = single_process_grads(c.micro, &ref_loss);
    nn::Gpt probe(small_gpt(), 5, {0, 1});
    const auto cuts = balance_stages(probe.block_flops(), probe.block_params(), c.stages);
    std::mutex mu;
    std::map<std::string, std::vector<float>> got;
    double got_loss = 0.0;
    std::vector<int> in_flight(static_cast<size_t>(c.stages));
    run_ranks(c.stages, [&](comm::Group& g) {
      nn::Gpt stage(small_gpt(), 5, cuts[static_cast<size_t>(g.rank())]);
      Pipeline pipe(stage, g, {c.schedule, c.micro, c.recompute});
      int backwards = 0, last_flag = 0;
      StageStats st;
      const double loss = pipe.train_step(
          micro_batch, 1.0f / static_cast<float>(c.micro),
          [&](bool last) {
            ++backwards;
            last_flag += last ? backwards : 0;
          },
          &st);
      EXPECT_EQ(backwards, c.micro);
      EXPECT_EQ(last_flag, c.micro) << "only the final backward is flagged last";
      EXPECT_GT(st.busy_s, 0.0);
      EXPECT_LE(st.busy_s, st.step_s);
      EXPECT_EQ(st.spans.size(), static_cast<size_t>(2 * c.micro));
      std::lock_guard<std::mutex> lock(mu);
      in_flight[static_cast<size_t>(g.rank())] = st.max_in_flight;
      if (pipe.last()) got_loss = loss;
      for (const auto& [name, p] : stage.named_parameters()) got[name] = p.grad().to_vector();
    });
    EXPECT_EQ(got_loss, ref_loss);
    ASSERT_EQ(got.size(), ref.size());
    for (const auto& [name, g] : ref) EXPECT_EQ(got.at(name), g) << name << " differs from one process";
    for (int s = 0; s < c.stages; ++s) {
      EXPECT_EQ(in_flight[static_cast<size_t>(s)],
                c.schedule == Schedule::gpipe ? c.micro : std::min(c.stages - s, c.micro));
    }
  }
}

TEST(Pipeline, ForwardOnlyReturnsTheWholeModelsOutputOnTheLastStage) {
  nn::Gpt model(small_gpt(), 5);
  const Tensor x = micro_batch(0).first;
  const std::vector<float> want = [&] {
    NoGradGuard no_grad;
    return model.forward(x).to_vector();
  }();
  run_ranks(3, [&](comm::Group& g) {
    nn::Gpt stage(small_gpt(), 5, parse_stages("0-1,2-3,4-5", 6, 3)[static_cast<size_t>(g.rank())]);
    Pipeline pipe(stage, g, {});
    Tensor out = pipe.forward_only(x);
    if (pipe.last()) {
      EXPECT_EQ(out.to_vector(), want);
    } else {
      EXPECT_FALSE(out.defined());
    }
  });
}

TEST(Pipeline, AMalformedActivationHeaderFromThePreviousStageIsAClearError) {
  run_ranks(2, [&](comm::Group& g) {
    if (g.rank() == 0) {
      std::vector<int64_t> header = {99, 1, 1, 1, 1, 1, 1};
      g.send(header.data(), header.size(), comm::DataType::i64, 1, 1);
      return;
    }
    nn::Gpt stage(small_gpt(), 5, {3, 6});
    Pipeline pipe(stage, g, {});
    try {
      pipe.forward_only(Tensor());
      FAIL() << "accepted a 99-dimensional activation";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("malformed activation header from stage 0"), std::string::npos) << e.what();
    }
  });
}

TEST(Pipeline, ShapesAreAgreedAtTheFirstMicroBatchAndAChangeIsAClearError) {
  run_ranks(2, [&](comm::Group& g) {
    nn::Gpt stage(small_gpt(), 5, g.rank() == 0 ? nn::BlockRange{0, 3} : nn::BlockRange{3, 6});
    Pipeline pipe(stage, g, {Schedule::one_f_one_b, 2, false});
    // Two steps of the agreed shape (header only in the first), then a shorter sequence.
    for (int step = 0; step < 2; ++step) pipe.train_step(micro_batch, 0.5f, nullptr);
    auto shorter = [](int m) {
      auto [x, y] = micro_batch(m);
      return std::make_pair(x.slice(1, 0, 4).contiguous(), y.slice(1, 0, 4).contiguous());
    };
    if (g.rank() == 1) return;  // stage 0 notices before it sends anything
    try {
      pipe.train_step(shorter, 0.5f, nullptr);
      FAIL() << "an activation of another shape was sent";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("which agreed on [2, 8, 16]"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace dtrain::parallel
