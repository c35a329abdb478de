// DataParallel with ranks as threads over the real shm transport: identical parameters on
// every rank after every step, the same math as one process (bitwise against the same
// micro-batches, within float tolerance against the unsplit batch), ZeRO-1/2 equal to plain
// DDP with 1/world of the optimizer state, parameters without gradients, and misuse errors.
#include "dtrain/parallel/ddp.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm_test_util.h"
#include "dtrain/comm/group.h"
#include "dtrain/nn/models.h"
#include "dtrain/optim/optim.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/random.h"

namespace dtrain::parallel {
namespace {

constexpr int64_t kIn = 24, kClasses = 5, kBatch = 24;  // 24: divisible by 1, 2, 3, 4 ranks x 2 micro-steps

void run_ranks(int size, const std::function<void(comm::Group&)>& fn) {
  comm::test_util::run_ranks(size, fn, comm::test_util::quick_options());
}

// A fixed data set: step s uses rows [s*kBatch, (s+1)*kBatch).
struct Data {
  std::vector<float> x, y;
  explicit Data(int steps) {
    Generator gen(7);
    Tensor t = Tensor::randn({steps * kBatch, kIn}, gen);
    x = t.to_vector();
    for (int64_t i = 0; i < steps * kBatch; ++i) y.push_back(static_cast<float>((i * 7) % kClasses));
  }
  // Rows [begin, begin + n).
  std::pair<Tensor, Tensor> rows(int64_t begin, int64_t n) const {
    std::vector<float> xs(x.begin() + begin * kIn, x.begin() + (begin + n) * kIn);
    std::vector<float> ys(y.begin() + begin, y.begin() + begin + n);
    return {Tensor::from_vector({n, kIn}, xs), Tensor::from_vector({n}, ys)};
  }
};

std::shared_ptr<nn::Mlp> make_model(uint64_t seed = 3, std::vector<int64_t> hidden = {32, 16}) {
  return std::make_shared<nn::Mlp>(kIn, hidden, kClasses, seed);
}

std::vector<float> flat(const nn::Model& m) {
  std::vector<float> out;
  for (const auto& [name, t] : m.named_parameters()) {
    auto v = t.to_vector();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

struct RunOptions {
  int world = 1;
  int accumulate = 1;
  int zero = 0;
  bool share_memory = true;
  bool adam = true;
  bool int8_state = false;     // AdamW's moments in 8 bits
  size_t bucket_bytes = 1024;  // several buckets for this small model
  std::vector<int64_t> hidden = {32, 16};
  int steps = 6;
  std::string compress = "none";
  // Filled in: final parameters of every rank, and per-step parameters of every rank.
  std::vector<std::vector<float>> final_params;
  std::vector<std::vector<std::vector<float>>> per_step;  // [step][rank]
  std::vector<int64_t> optimizer_bytes;
  std::vector<MemoryReport> memory;    // per rank, at the end
  std::vector<int64_t> gathered_peak;  // ZeRO 3: the most whole-block bytes gathered at once, per rank
  int64_t live_bytes = 0;              // tensor storages all ranks hold after the last step (dtrain::memory)
  std::vector<CommVolume> volume;      // per rank, over all steps
  bool shared = false;                 // rank 0's DataParallel shares memory
  bool shared_params = false;          // ... and the parameters in it
};

std::unique_ptr<optim::Optimizer> make_opt(bool adam, std::vector<Tensor> params, bool int8_state = false) {
  if (adam) {
    return std::make_unique<optim::AdamW>(std::move(params), 1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f,
                                          int8_state ? optim::StateFormat::int8 : optim::StateFormat::f32);
  }
  return std::make_unique<optim::Sgd>(std::move(params), 0.1f, 0.9f);
}

// The trainer's loop: rank r's micro-step m takes slice (m * world + r) of each global batch.
void train(RunOptions& o) {
  const Data data(o.steps);
  o.final_params.assign(static_cast<size_t>(o.world), {});
  o.per_step.assign(static_cast<size_t>(o.steps), std::vector<std::vector<float>>(static_cast<size_t>(o.world)));
  o.optimizer_bytes.assign(static_cast<size_t>(o.world), 0);
  o.memory.assign(static_cast<size_t>(o.world), MemoryReport{});
  o.gathered_peak.assign(static_cast<size_t>(o.world), 0);
  o.volume.assign(static_cast<size_t>(o.world), CommVolume{});
  const int64_t micro = kBatch / (o.world * o.accumulate);
  if (o.world == 1 && o.zero == 0) {
    auto model = make_model(3, o.hidden);
    auto opt = make_opt(o.adam, model->parameters(), o.int8_state);
    for (int s = 0; s < o.steps; ++s) {
      for (int m = 0; m < o.accumulate; ++m) {
        auto [x, y] = data.rows(s * kBatch + m * micro, micro);
        Tensor loss = model->loss(model->forward(x), y) * (1.0f / static_cast<float>(o.accumulate));
        loss.backward();
      }
      opt->step();
      opt->zero_grad();
      o.per_step[static_cast<size_t>(s)][0] = flat(*model);
    }
    o.final_params[0] = flat(*model);
    return;
  }
  const int64_t live_before = memory::live_bytes();
  run_ranks(o.world, [&](comm::Group& g) {
    const int r = g.rank();
    // Ranks other than 0 start elsewhere: the broadcast must give them rank 0's values.
    auto model = make_model(r == 0 ? 3 : 100 + static_cast<uint64_t>(r), o.hidden);
    DdpOptions d;
    d.bucket_bytes = o.bucket_bytes;
    d.zero = o.zero;
    d.share_memory = o.share_memory;
    d.compress = o.compress;
    if (o.zero == 3) d.units = block_units(*model);
    DataParallel dp(model->named_parameters(), g, d);
    dp.broadcast_parameters();
    model->set_block_hooks(dp.block_hooks());
    // ZeRO 3 holds pieces only: the whole parameters come from gathering them (collective).
    auto params_now = [&] {
      if (o.zero != 3) return flat(*model);
      std::vector<float> out;
      for (const Tensor& t : dp.gather_pieces(dp.optimizer_params())) {
        const std::vector<float> v = t.to_vector();
        out.insert(out.end(), v.begin(), v.end());
      }
      return out;
    };
    auto opt = make_opt(o.adam, dp.optimizer_params(), o.int8_state);
    for (int s = 0; s < o.steps; ++s) {
      for (int m = 0; m < o.accumulate; ++m) {
        auto [x, y] = data.rows(s * kBatch + (m * o.world + r) * micro, micro);
        dp.set_sync(m == o.accumulate - 1);
        Tensor loss = model->loss(model->forward(x), y) * (1.0f / static_cast<float>(o.accumulate));
        loss.backward();
      }
      dp.synchronize();
      opt->step();
      dp.gather_parameters();
      dp.zero_grad();
      opt->zero_grad();
      o.per_step[static_cast<size_t>(s)][static_cast<size_t>(r)] = params_now();
    }
    o.final_params[static_cast<size_t>(r)] = params_now();
    o.optimizer_bytes[static_cast<size_t>(r)] = dp.memory(*opt).optimizer_bytes;
    o.memory[static_cast<size_t>(r)] = dp.memory(*opt);
    o.gathered_peak[static_cast<size_t>(r)] = dp.gathered_peak_bytes();
    // What the allocator holds while every rank still holds its model, reducer and optimizer.
    g.barrier();
    if (r == 0) o.live_bytes = memory::live_bytes() - live_before;
    g.barrier();
    o.volume[static_cast<size_t>(r)] = dp.take_comm_volume();
    if (r == 0) o.shared = dp.shares_memory();
    if (r == 0) o.shared_params = dp.shares_parameters();
  });
}

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, mag = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::fabs(a[i] - b[i])));
    mag = std::max(mag, static_cast<double>(std::fabs(a[i])));
  }
  return diff / mag;
}

TEST(DataParallel, EveryRankHoldsIdenticalParametersAfterEveryStep) {
  for (int world : {2, 3, 4}) {
    RunOptions o;
    o.world = world;
    train(o);
    for (int s = 0; s < o.steps; ++s) {
      for (int r = 1; r < world; ++r) {
        ASSERT_EQ(o.per_step[static_cast<size_t>(s)][0], o.per_step[static_cast<size_t>(s)][static_cast<size_t>(r)])
            << "world " << world << ", step " << s + 1 << ": rank " << r << " differs from rank 0";
      }
    }
  }
}

TEST(DataParallel, EqualsOneProcessWithTheSameMicroBatchesBitwise) {
  // One process accumulating `world` micro-batches (loss scaled by 1/world, exact for powers of
  // two) does DDP's arithmetic exactly: the collectives sum in rank order. Small buckets take
  // the direct all_reduce's small-message path, one large bucket its reduce-scatter path.
  for (int world : {2, 4}) {
    for (size_t bucket : {size_t{1024}, size_t{1} << 20}) {
      RunOptions single;
      single.accumulate = world;
      single.hidden = {256, 64};
      train(single);
      RunOptions dp;
      dp.world = world;
      dp.hidden = {256, 64};
      dp.bucket_bytes = bucket;
      train(dp);
      EXPECT_EQ(single.final_params[0], dp.final_params[0]) << "world " << world << ", bucket " << bucket;
    }
  }
}

TEST(DataParallel, Int8OptimizerStateEqualsOneProcessBitwiseInAQuarterOfTheBytes) {
  // Every rank quantizes the same averaged moments in the same blocks: the same bits as one
  // process accumulating the same micro-batches, and (ZeRO 0) every rank holds the 8-bit state.
  RunOptions f32;
  f32.world = 2;
  f32.hidden = {256, 64};
  train(f32);
  RunOptions single;
  single.accumulate = 2;
  single.hidden = {256, 64};
  single.int8_state = true;
  train(single);
  RunOptions dp;
  dp.world = 2;
  dp.hidden = {256, 64};
  dp.int8_state = true;
  train(dp);
  EXPECT_EQ(single.final_params[0], dp.final_params[0]);
  EXPECT_EQ(dp.final_params[0], dp.final_params[1]);
  EXPECT_NE(dp.final_params[0], f32.final_params[0]);  // the state really was quantized
  // Close to f32: AdamW moves an element about lr (1e-2) a step; the codes change some moves by a
  // fraction of that (6 steps: under a tenth of the largest parameter).
  EXPECT_LT(max_rel(f32.final_params[0], dp.final_params[0]), 0.1);
  EXPECT_GE(static_cast<double>(f32.optimizer_bytes[0]) / static_cast<double>(dp.optimizer_bytes[0]), 3.9);
}

TEST(DataParallel, MatchesOneProcessOnTheWholeBatchWithinFloatTolerance) {
  RunOptions single;
  single.adam = false;
  train(single);
  for (int world : {2, 3, 4}) {
    RunOptions dp;
    dp.adam = false;
    dp.world = world;
    train(dp);
    EXPECT_LT(max_rel(single.final_params[0], dp.final_params[0]), 1e-5) << "world " << world;
  }
  // 2 ranks x 2 micro-steps against 4 ranks x 1.
  RunOptions a, b;
  a.adam = b.adam = false;
  a.world = 2;
  a.accumulate = 2;
  b.world = 4;
  train(a);
  train(b);
  EXPECT_LT(max_rel(a.final_params[0], b.final_params[0]), 1e-5);
}

TEST(DataParallel, ZeroOneAndTwoEqualPlainDdpWithAQuarterOfTheOptimizerState) {
  RunOptions plain;
  plain.world = 4;
  train(plain);
  for (int zero : {1, 2}) {
    RunOptions z;
    z.world = 4;
    z.zero = zero;
    train(z);
    EXPECT_EQ(plain.final_params[0], z.final_params[0]) << "zero " << zero;
    for (int r = 0; r < 4; ++r) {
      EXPECT_LE(static_cast<double>(z.optimizer_bytes[static_cast<size_t>(r)]),
                static_cast<double>(plain.optimizer_bytes[0]) / 4 * 1.05)
          << "zero " << zero << " rank " << r;
    }
  }
}

// ZeRO 3: parameters sharded too, gathered per block around its forward and backward. AdamW
// equals one process accumulating the same micro-batches bit for bit (2 and 4 ranks: the sums run
// in rank order and 1/world is exact), SGD the whole batch within 1e-5 after 50 steps on 2, 3
// and 4 ranks, with --accumulate too; every rank holds 1/world of the state (+5%) between steps.
// Both ways a rank holds its pieces: slices of the host's one shared copy (share_memory, nothing
// gathered) and on the heap, gathered around each block's use.
TEST(DataParallel, ZeroThreeEqualsOneProcess) {
  for (int world : {2, 4}) {
    RunOptions single;
    single.accumulate = world;
    single.hidden = {256, 64};
    train(single);
    for (size_t bucket : {size_t{1024}, size_t{1} << 20}) {
      for (bool share : {true, false}) {
        RunOptions z;
        z.world = world;
        z.zero = 3;
        z.hidden = {256, 64};
        z.bucket_bytes = bucket;
        z.share_memory = share;
        train(z);
        EXPECT_EQ(z.shared_params, share) << "world " << world;
        EXPECT_EQ(single.final_params[0], z.final_params[0])
            << "world " << world << ", bucket " << bucket << ", shared " << share;
        for (int r = 1; r < world; ++r) EXPECT_EQ(z.final_params[0], z.final_params[static_cast<size_t>(r)]);
      }
    }
  }
  RunOptions single;
  single.adam = false;
  single.steps = 50;
  train(single);
  for (int world : {2, 3, 4}) {
    for (int accumulate : {1, 2}) {
      if (world == 4 && accumulate == 2) continue;  // 24 rows: 3 per micro-batch at most 8 micro-batches
      RunOptions z;
      z.adam = false;
      z.steps = 50;
      z.world = world;
      z.accumulate = accumulate;
      z.zero = 3;
      train(z);
      EXPECT_LT(max_rel(single.final_params[0], z.final_params[0]), 1e-5)
          << "world " << world << ", accumulate " << accumulate;
    }
  }
}

TEST(DataParallel, ZeroThreeHoldsAQuarterOfTheStateBetweenSteps) {
  RunOptions plain;
  plain.world = 4;
  plain.hidden = {256, 64};
  plain.share_memory = false;  // its buckets on the heap, where dtrain::memory counts them
  train(plain);
  RunOptions z;
  z.world = 4;
  z.zero = 3;
  z.hidden = {256, 64};
  z.share_memory = false;  // the pieces on the heap too, gathered around each block
  train(z);
  EXPECT_EQ(plain.final_params[0], z.final_params[0]);
  // The allocator agrees: the four ranks together hold what one plain rank does (+5%).
  EXPECT_GT(z.live_bytes, 0);
  EXPECT_LE(static_cast<double>(z.live_bytes), static_cast<double>(plain.live_bytes) / 4 * 1.05)
      << "ZeRO 3 " << z.live_bytes << " bytes on 4 ranks, plain " << plain.live_bytes;
  const MemoryReport& full = plain.memory[0];
  const double total = static_cast<double>(full.param_bytes + full.grad_bytes + full.optimizer_bytes);
  // The two largest neighbouring blocks: fc0 (24 x 256 + 256 floats) and fc1 (256 x 64 + 64).
  const int64_t two_blocks = (kIn * 256 + 256 + 256 * 64 + 64) * 4;
  for (int r = 0; r < 4; ++r) {
    const MemoryReport& m = z.memory[static_cast<size_t>(r)];
    EXPECT_LE(static_cast<double>(m.param_bytes + m.grad_bytes + m.optimizer_bytes), total / 4 * 1.05) << "rank " << r;
    EXPECT_LE(static_cast<double>(m.param_bytes), static_cast<double>(full.param_bytes) / 4 * 1.05) << "rank " << r;
    // While a block runs: it and the next one (prefetched), never the whole model.
    EXPECT_GT(z.gathered_peak[static_cast<size_t>(r)], 0);
    EXPECT_LE(static_cast<double>(z.gathered_peak[static_cast<size_t>(r)]), two_blocks * 1.05) << "rank " << r;
    EXPECT_LT(z.gathered_peak[static_cast<size_t>(r)], full.param_bytes) << "rank " << r;
  }
  // One host sharing memory: the pieces are slices of one copy of the parameters for the four
  // ranks, so nothing is gathered, and the heap holds 1/4 of the gradients and state per rank.
  RunOptions shared = z;
  shared.share_memory = true;
  train(shared);
  ASSERT_TRUE(shared.shared_params);
  EXPECT_EQ(plain.final_params[0], shared.final_params[0]);
  const int64_t params_per_rank = full.param_bytes / 4;
  // The allocator sees the heap; the shared copy is one rank's parameters for all four.
  EXPECT_GT(shared.live_bytes, 0);
  EXPECT_LE(static_cast<double>(shared.live_bytes + full.param_bytes), static_cast<double>(plain.live_bytes) / 4 * 1.05)
      << "ZeRO 3 on shared memory: " << shared.live_bytes << " heap bytes on 4 ranks, plain " << plain.live_bytes;
  for (int r = 0; r < 4; ++r) {
    const MemoryReport& m = shared.memory[static_cast<size_t>(r)];
    EXPECT_LE(static_cast<double>(m.param_bytes + m.grad_bytes + m.optimizer_bytes), total / 4 * 1.05) << "rank " << r;
    EXPECT_GE(m.param_bytes, params_per_rank) << "rank " << r;
    EXPECT_LE(static_cast<double>(m.param_bytes), params_per_rank * 1.05) << "rank " << r;
    EXPECT_EQ(shared.gathered_peak[static_cast<size_t>(r)], 0) << "rank " << r;
  }
}

TEST(DataParallel, SharedMemoryZeroOneEqualsTheCopyingPathBitwise) {
  for (int world : {2, 3, 4}) {
    for (size_t bucket : {size_t{1024}, size_t{1} << 20}) {
      RunOptions copying, shared;
      copying.world = shared.world = world;
      copying.zero = shared.zero = 1;
      copying.bucket_bytes = shared.bucket_bytes = bucket;
      copying.share_memory = false;
      train(copying);
      train(shared);
      ASSERT_FALSE(copying.shared);
      ASSERT_TRUE(shared.shared) << "world " << world << ": the one-host ZeRO-1 run did not share memory";
      ASSERT_TRUE(shared.shared_params) << "world " << world;
      // The averaged pieces lie over the shared slots: the gradients take the slots only,
      // world / (world + 1) of the copying path's slots and pieces.
      for (int r = 0; r < world; ++r) {
        const auto shared_grads = shared.memory[static_cast<size_t>(r)].grad_bytes;
        const auto copying_grads = copying.memory[static_cast<size_t>(r)].grad_bytes;
        EXPECT_GT(shared_grads, 0);
        EXPECT_EQ(shared_grads * (world + 1), copying_grads * world)
            << "world " << world << ", rank " << r << ": " << shared_grads << " gradient bytes shared, "
            << copying_grads << " copying";
      }
      for (int s = 0; s < copying.steps; ++s) {
        ASSERT_EQ(copying.per_step[static_cast<size_t>(s)][0], shared.per_step[static_cast<size_t>(s)][0])
            << "world " << world << ", bucket " << bucket << ", step " << s + 1;
      }
    }
  }
}

TEST(DataParallel, SharedMemoryZeroZeroEqualsTheCopyingPathBitwise) {
  // Gradients averaged by all_reduce_shared in the ranks' shared slots, against the copying
  // all_reduce; with accumulation (the slots keep summing between synchronizations) and SGD.
  // The small model's buckets stay under 16 KiB (the copying all_reduce on the slots); the
  // wider one's 1 MiB bucket takes all_reduce_shared with several 32 KiB blocks per rank.
  for (int world : {2, 3, 4}) {
    for (size_t bucket_or_wide : {size_t{1024}, size_t{1} << 20, size_t{0}}) {
      const bool wide = bucket_or_wide == 0;
      const size_t bucket = wide ? size_t{1} << 20 : bucket_or_wide;
      for (int accumulate : {1, 2}) {
        RunOptions copying, shared;
        if (wide) {
          copying.hidden = shared.hidden = {512, 256};
          copying.steps = shared.steps = 3;
        }
        copying.world = shared.world = world;
        copying.bucket_bytes = shared.bucket_bytes = bucket;
        copying.accumulate = shared.accumulate = accumulate;
        copying.adam = shared.adam = accumulate == 1;
        copying.share_memory = false;
        train(copying);
        train(shared);
        ASSERT_FALSE(copying.shared);
        ASSERT_TRUE(shared.shared) << "world " << world << ": the one-host ZeRO-0 run did not share memory";
        ASSERT_FALSE(shared.shared_params) << "world " << world << ": ZeRO 0 keeps a copy of the parameters per rank";
        for (int s = 0; s < copying.steps; ++s) {
          for (int r = 0; r < world; ++r) {
            ASSERT_EQ(copying.per_step[static_cast<size_t>(s)][static_cast<size_t>(r)],
                      shared.per_step[static_cast<size_t>(s)][static_cast<size_t>(r)])
                << "world " << world << ", bucket " << bucket << (wide ? " (wide)" : "") << ", accumulate "
                << accumulate << ", step " << s + 1 << ", rank " << r;
          }
        }
      }
    }
  }
}

TEST(DataParallel, AParameterWithoutGradientOnOneRankCountsAsZero) {
  // Rank 1 never uses the second head: its gradient there is zero, averaged with rank 0's.
  run_ranks(2, [](comm::Group& g) {
    Generator gen(1);
    Tensor a = Tensor::randn({4}, gen).set_requires_grad(true);
    Tensor b = Tensor::randn({4}, gen).set_requires_grad(true);
    DdpOptions o;
    o.bucket_bytes = 16;  // one bucket each
    DataParallel dp({{"a", a}, {"b", b}}, g, o);
    dp.broadcast_parameters();
    Tensor loss = ops::sum(a * 2.0f);
    if (g.rank() == 0) loss = loss + ops::sum(b * 4.0f);
    loss.backward();
    dp.synchronize();
    for (float v : a.grad().to_vector()) EXPECT_EQ(v, 2.0f);
    for (float v : b.grad().to_vector()) EXPECT_EQ(v, 2.0f);  // (4 + 0) / 2
  });
}

TEST(DataParallel, MisuseGetsClearErrors) {
  // Backward twice with sync on.
  EXPECT_THROW(
      {
        try {
          run_ranks(1, [](comm::Group& g) {
            auto model = make_model();
            DataParallel dp(model->named_parameters(), g, {});
            Data data(1);
            for (int k = 0; k < 2; ++k) {
              auto [x, y] = data.rows(0, 4);
              model->loss(model->forward(x), y).backward();
            }
          });
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("backward ran more than once"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  // A rank that skipped backward.
  std::mutex mu;
  std::vector<std::string> messages;
  try {
    run_ranks(2, [&](comm::Group& g) {
      auto model = make_model();
      DataParallel dp(model->named_parameters(), g, {});
      dp.broadcast_parameters();
      Data data(1);
      if (g.rank() == 0) {
        auto [x, y] = data.rows(0, 4);
        model->loss(model->forward(x), y).backward();
      }
      try {
        dp.synchronize();
      } catch (const Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        messages.push_back(e.what());
        throw;
      }
    });
  } catch (const Error&) {
  }
  ASSERT_EQ(messages.size(), 2u);
  for (const auto& m : messages) {
    EXPECT_NE(m.find("rank 0: backward, rank 1: none"), std::string::npos) << m;
  }
  // Different models on different ranks.
  messages.clear();
  try {
    run_ranks(2, [&](comm::Group& g) {
      auto model = std::make_shared<nn::Mlp>(kIn, std::vector<int64_t>{g.rank() == 0 ? 32 : 33}, kClasses, 1);
      DataParallel dp(model->named_parameters(), g, {});
      try {
        dp.broadcast_parameters();
      } catch (const Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        messages.push_back(e.what());
        throw;
      }
    });
  } catch (const Error&) {
  }
  ASSERT_EQ(messages.size(), 2u);
  for (const auto& m : messages) EXPECT_NE(m.find("rank 1's model differs from rank 0's"), std::string::npos) << m;
}

// Compressed gradients: every codec keeps the ranks bitwise identical, stays near the f32
// run, and sends the bytes it should (counted by the collective, not estimated).
TEST(Compression, EveryCodecKeepsRanksIdenticalNearTheF32RunWithFewerBytes) {
  struct Case {
    std::string compress;
    int zero;
    double tol;        // max relative difference to the f32 run after the steps
    double min_ratio;  // f32 bytes / wire bytes
  };
  const std::vector<Case> cases = {{"bf16", 0, 2e-2, 1.9},     {"fp16", 0, 5e-3, 1.9}, {"int8", 0, 5e-2, 3.0},
                                   {"int8", 1, 5e-2, 3.0},     {"int4", 0, 0.3, 5.0},  {"int4", 2, 0.3, 5.0},
                                   {"powersgd:2", 0, 1.0, 4.0}};
  for (int world : {2, 3}) {
    RunOptions ref;
    ref.world = world;
    ref.adam = false;
    ref.hidden = {64, 32};
    train(ref);
    for (const Case& c : cases) {
      RunOptions o = ref;
      o.compress = c.compress;
      o.zero = c.zero;
      train(o);
      const std::string what = c.compress + " zero " + std::to_string(c.zero) + " world " + std::to_string(world);
      for (int s = 0; s < o.steps; ++s) {
        for (int r = 1; r < world; ++r) {
          ASSERT_EQ(o.per_step[static_cast<size_t>(s)][0], o.per_step[static_cast<size_t>(s)][static_cast<size_t>(r)])
              << what << ": rank " << r << " differs at step " << s + 1;
        }
      }
      const double rel = max_rel(ref.final_params[0], o.final_params[0]);
      EXPECT_LT(rel, c.tol) << what;
      EXPECT_GT(rel, 0.0) << what << ": compression changed nothing?";
      const CommVolume v = o.volume[0];
      ASSERT_GT(v.wire_bytes, 0u) << what;
      EXPECT_GE(static_cast<double>(v.raw_bytes) / static_cast<double>(v.wire_bytes), c.min_ratio) << what;
    }
  }
}

// Error feedback: what one step's encoding loses is sent with the next one, so the gradients
// delivered over many steps add up to the true ones. A constant gradient with one large entry
// makes int4's step (large / 7) far bigger than the small entries: without feedback they would
// arrive as zeros at every step.
TEST(Compression, ErrorFeedbackDeliversSmallGradientsOverSteps) {
  constexpr int kSteps = 400;
  constexpr int64_t kN = 600;
  run_ranks(2, [](comm::Group& g) {
    Tensor a = Tensor::zeros({kN}).set_requires_grad(true);
    std::vector<float> c(kN, 0.05f);
    c[7] = 10.0f;
    const Tensor coef = Tensor::from_vector({kN}, c);
    DdpOptions o;
    o.compress = "int4";
    DataParallel dp({{"a", a}}, g, o);
    std::vector<double> delivered(kN, 0.0);
    for (int s = 0; s < kSteps; ++s) {
      ops::sum(a * coef).backward();
      dp.synchronize();
      const std::vector<float> grad = a.grad().to_vector();
      for (int64_t i = 0; i < kN; ++i) delivered[static_cast<size_t>(i)] += grad[static_cast<size_t>(i)];
      dp.zero_grad();
    }
    // One step's error: half an int4 step of the input (10 / 14) and of the result, per contributor.
    const double bound = 4 * 10.0 / 14;
    for (int64_t i = 0; i < kN; ++i) {
      ASSERT_NEAR(delivered[static_cast<size_t>(i)], kSteps * c[static_cast<size_t>(i)], bound) << "element " << i;
    }
  });
}

// PowerSGD rank 1 on a constant rank-2 gradient: each step delivers a rank-1 approximation, and
// error feedback sends the rest later, so the sum over steps approaches the sum of the true ones.
TEST(Compression, PowerSgdErrorFeedbackRecoversWhatRankOneCannotCarry) {
  constexpr int kSteps = 200;
  constexpr int64_t kRows = 12, kCols = 10;
  run_ranks(2, [](comm::Group& g) {
    Tensor w = Tensor::zeros({kRows, kCols}).set_requires_grad(true);
    std::vector<float> c(kRows * kCols);
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t j = 0; j < kCols; ++j) {
        c[static_cast<size_t>(i * kCols + j)] = static_cast<float>(std::sin(0.3 * (i + 1)) * std::cos(0.2 * j) +
                                                                   0.5 * std::cos(0.7 * i) * std::sin(0.9 * (j + 1)));
      }
    }
    const Tensor coef = Tensor::from_vector({kRows, kCols}, c);
    DdpOptions o;
    o.compress = "powersgd:1";
    DataParallel dp({{"w", w}}, g, o);
    std::vector<double> delivered(c.size(), 0.0);
    double first_err = 0.0, norm = 0.0;
    for (int s = 0; s < kSteps; ++s) {
      ops::sum(w * coef).backward();
      dp.synchronize();
      const std::vector<float> grad = w.grad().to_vector();
      for (size_t i = 0; i < c.size(); ++i) {
        delivered[i] += grad[i];
        if (s == 0) {
          first_err += (grad[i] - c[i]) * (grad[i] - c[i]);
          norm += static_cast<double>(c[i]) * c[i];
        }
      }
      dp.zero_grad();
    }
    double err = 0.0;
    for (size_t i = 0; i < c.size(); ++i) err += std::pow(delivered[i] - kSteps * c[i], 2);
    // One step misses a whole component; the sum over 200 steps misses at most a few steps' worth.
    EXPECT_GT(std::sqrt(first_err / norm), 0.1);
    EXPECT_LT(std::sqrt(err / norm) / kSteps, 0.02);
  });
}

}  // namespace
}  // namespace dtrain::parallel
