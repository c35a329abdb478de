// DistributedDataParallel for libtorch with ranks as threads over the real shm transport: the
// same math as one process on the same global batch (50 SGD steps, worlds 1-4, one or several
// buckets, shared or copied buckets, with and without overlap), rank 0's parameters and
// buffers everywhere, no_sync accumulation, buckets in reverse order of use started during
// backward, parameters without a gradient, compression, and the misuse errors of DataParallel.
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "comm_test_util.h"
#include "dtrain/comm/group.h"
#include "dtrain/torch/ddp.h"

// Outside namespace dtrain, where `torch` is libtorch (TORCH_MODULE needs that).
namespace {

namespace F = torch::nn::functional;
namespace comm = dtrain::comm;
using comm::Clock;
using dtrain::torch::DdpOptions;
using dtrain::torch::DistributedDataParallel;

constexpr int64_t kBatch = 24;  // divisible by 1, 2, 3, 4 ranks and by 3 micro-batches
constexpr int kSteps = 50;
constexpr int kClasses = 10;

// One libtorch thread: the ranks are threads already.
[[maybe_unused]] const bool kOneThread = (torch::set_num_threads(1), true);

void run_ranks(int size, const std::function<void(comm::Group&)>& fn) {
  comm::test_util::run_ranks(size, fn, comm::test_util::quick_options());
}

// A small CNN on (B, 1, 8, 8) images: conv -> relu -> pool -> fc1 -> relu -> fc2, registered
// in the order forward uses them.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    fc1 = register_module("fc1", torch::nn::Linear(4 * 4 * 4, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, kClasses));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::max_pool2d(torch::relu(conv->forward(x)), 2);
    return fc2->forward(torch::relu(fc1->forward(h.flatten(1))));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

// libtorch draws initial values from one global generator: models are built one at a time.
std::mutex& init_mutex() {
  static std::mutex mu;
  return mu;
}

template <typename M = Net>
M make_net(uint64_t seed) {
  std::lock_guard<std::mutex> lock(init_mutex());
  torch::manual_seed(seed);
  return M();
}

// A fixed data set: step s uses rows [s * kBatch, (s + 1) * kBatch).
struct Data {
  at::Tensor x, y;
  Data() {
    std::lock_guard<std::mutex> lock(init_mutex());
    torch::manual_seed(7);
    x = torch::randn({kSteps * kBatch, 1, 8, 8});
    y = torch::randint(kClasses, {kSteps * kBatch}, torch::kLong);
  }
  // Rank r of `world`'s slice of step s's global batch.
  std::pair<at::Tensor, at::Tensor> slice(int s, int r, int world) const {
    const int64_t n = kBatch / world, begin = s * kBatch + r * n;
    return {x.narrow(0, begin, n), y.narrow(0, begin, n)};
  }
};

const Data& data() {
  static const Data d;
  return d;
}

template <typename M>
torch::optim::SGD make_sgd(M& net) {
  return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

template <typename M>
std::vector<at::Tensor> snapshot(const M& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

// One process, no DDP: the reference.
template <typename M = Net>
std::vector<at::Tensor> train_alone(int steps) {
  M net = make_net<M>(0);
  auto sgd = make_sgd(net);
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = data().slice(s, 0, 1);
    F::cross_entropy(net->forward(x), y).backward();
    sgd.step();
    sgd.zero_grad();
  }
  return snapshot(net);
}

// max over tensors of max|a - b| / max|b|.
double relative_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double diff = (a[i] - b[i]).abs().max().item<double>();
    worst = std::max(worst, diff / std::max(1e-30, b[i].abs().max().item<double>()));
  }
  return worst;
}

bool bitwise_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].equal(b[i])) return false;
  }
  return true;
}

// Each rank trains its slices of the global batches with DDP; returns every rank's parameters.
template <typename M = Net>
std::vector<std::vector<at::Tensor>> train_ddp(int world, int steps, const DdpOptions& options) {
  std::vector<std::vector<at::Tensor>> out(static_cast<size_t>(world));
  run_ranks(world, [&](comm::Group& g) {
    M net = make_net<M>(static_cast<uint64_t>(g.rank()));  // different on each rank: the broadcast fixes that
    DistributedDataParallel ddp(net, g, options);
    auto sgd = make_sgd(net);
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = data().slice(s, g.rank(), world);
      F::cross_entropy(net->forward(x), y).backward();
      ddp.synchronize();
      sgd.step();
      sgd.zero_grad();
    }
    out[static_cast<size_t>(g.rank())] = snapshot(net);
  });
  return out;
}

TEST(LibtorchDdp, MatchesOneProcessOnTheSameGlobalBatchAfter50SgdSteps) {
  const std::vector<at::Tensor> alone = train_alone(kSteps);
  struct Case {
    std::string what;
    DdpOptions options;
  };
  std::vector<Case> cases(4);
  cases[0].what = "one bucket, shared memory";
  cases[1].what = "256-byte buckets";
  cases[1].options.bucket_bytes = 256;
  cases[2].what = "1 KiB buckets, copied (no shared memory)";
  cases[2].options.bucket_bytes = 1024;
  cases[2].options.share_memory = false;
  cases[3].what = "1 KiB buckets, no overlap";
  cases[3].options.bucket_bytes = 1024;
  cases[3].options.overlap = false;
  for (const Case& c : cases) {
    for (int world : {1, 2, 3, 4}) {
      const auto ranks = train_ddp(world, kSteps, c.options);
      for (int r = 1; r < world; ++r) {
        EXPECT_TRUE(bitwise_equal(ranks[static_cast<size_t>(r)], ranks[0]))
            << c.what << ", world " << world << ": rank " << r << " differs from rank 0";
      }
      const double diff = relative_difference(ranks[0], alone);
      std::printf("%s, world %d: largest relative difference to one process %.3g\n", c.what.c_str(), world, diff);
      if (world == 1) {
        EXPECT_EQ(diff, 0.0) << c.what << ": one rank under DDP must be the plain run bit for bit";
      } else {
        EXPECT_LE(diff, 1e-5) << c.what << ", world " << world;
        EXPECT_GT(relative_difference(ranks[0], snapshot(make_net(0))), 1e-2) << "the model did not train";
      }
    }
  }
}

// Parameters, buffers (BatchNorm statistics) and a frozen parameter.
struct ModelImpl : torch::nn::Module {
  ModelImpl() {
    fc = register_module("fc", torch::nn::Linear(3, 4));
    bn = register_module("bn", torch::nn::BatchNorm1d(4));
    frozen = register_parameter("frozen", torch::randn({5}), /*requires_grad=*/false);
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  at::Tensor frozen;
};
TORCH_MODULE(Model);

TEST(LibtorchDdp, BroadcastsRankZerosParametersAndBuffersIncludingFrozenOnes) {
  std::vector<std::vector<at::Tensor>> seen(3);
  run_ranks(3, [&](comm::Group& g) {
    Model m{nullptr};
    {
      std::lock_guard<std::mutex> lock(init_mutex());
      torch::manual_seed(100 + static_cast<uint64_t>(g.rank()));
      m = Model();
    }
    {
      torch::NoGradGuard no_grad;
      m->bn->running_mean.fill_(static_cast<float>(g.rank() + 1));
    }
    DistributedDataParallel ddp(m, g);
    EXPECT_EQ(ddp.num_buckets(), 1u);
    std::vector<at::Tensor> all;
    for (const auto& p : m->parameters()) all.push_back(p.detach().clone());
    for (const auto& b : m->buffers()) all.push_back(b.clone());
    seen[static_cast<size_t>(g.rank())] = all;
    EXPECT_TRUE(m->bn->running_mean.equal(torch::ones({4}))) << "rank " << g.rank() << " kept its own buffer";
    // broadcast_buffers() repeats it for buffers that changed.
    {
      torch::NoGradGuard no_grad;
      m->bn->running_var.fill_(static_cast<float>(g.rank() + 5));
    }
    ddp.broadcast_buffers();
    EXPECT_TRUE(m->bn->running_var.equal(torch::full({4}, 5.0f))) << "rank " << g.rank();
  });
  for (int r = 1; r < 3; ++r) EXPECT_TRUE(bitwise_equal(seen[static_cast<size_t>(r)], seen[0])) << "rank " << r;
}

TEST(LibtorchDdp, NoSyncAccumulatesLocallyThenAveragesOnce) {
  constexpr int kMicro = 3, kAccSteps = 10;
  // Reference: one process, the global batch in kMicro micro-batches, each loss / kMicro.
  auto micro = [](int s, int m, int r, int world) {
    auto [x, y] = data().slice(s, r, world);
    const int64_t n = x.size(0) / kMicro;
    return std::make_pair(x.narrow(0, m * n, n), y.narrow(0, m * n, n));
  };
  Net ref = make_net(0);
  auto ref_sgd = make_sgd(ref);
  for (int s = 0; s < kAccSteps; ++s) {
    for (int m = 0; m < kMicro; ++m) {
      auto [x, y] = micro(s, m, 0, 1);
      (F::cross_entropy(ref->forward(x), y) / kMicro).backward();
    }
    ref_sgd.step();
    ref_sgd.zero_grad();
  }
  std::vector<at::Tensor> ranks0;
  run_ranks(2, [&](comm::Group& g) {
    Net net = make_net(static_cast<uint64_t>(g.rank()));
    DdpOptions o;
    o.share_memory = false;  // the copying all_reduce counts its bytes
    o.bucket_bytes = 1024;
    DistributedDataParallel ddp(net, g, o);
    auto sgd = make_sgd(net);
    for (int s = 0; s < kAccSteps; ++s) {
      for (int m = 0; m < kMicro; ++m) {
        auto [x, y] = micro(s, m, g.rank(), 2);
        if (m < kMicro - 1) {
          auto scope = ddp.no_sync();
          EXPECT_FALSE(ddp.sync());
          (F::cross_entropy(net->forward(x), y) / kMicro).backward();
          EXPECT_EQ(ddp.take_comm_volume().raw_bytes, 0u) << "no_sync backward communicated";
        } else {
          EXPECT_TRUE(ddp.sync());
          (F::cross_entropy(net->forward(x), y) / kMicro).backward();
        }
      }
      ddp.synchronize();
      EXPECT_GT(ddp.take_comm_volume().raw_bytes, 0u);
      sgd.step();
      sgd.zero_grad();
    }
    if (g.rank() == 0) ranks0 = snapshot(net);
  });
  EXPECT_LE(relative_difference(ranks0, snapshot(ref)), 1e-5);
}

TEST(LibtorchDdp, BucketsFollowReverseOrderOfUseAndStartDuringBackward) {
  for (bool overlap : {true, false}) {
    run_ranks(2, [&](comm::Group& g) {
      Net net = make_net(0);
      DdpOptions o;
      o.bucket_bytes = 350 * 4;  // 350 floats: fc2 | fc1.bias | fc1.weight | conv
      o.record_events = true;
      o.overlap = overlap;
      o.rebuild_buckets = false;  // this layout throughout (the next test rebuilds)
      DistributedDataParallel ddp(net, g, o);
      ASSERT_EQ(ddp.num_buckets(), 4u);
      EXPECT_EQ(ddp.bucket_parameters(0), (std::vector<std::string>{"fc2.bias", "fc2.weight"}));
      EXPECT_EQ(ddp.bucket_parameters(1), (std::vector<std::string>{"fc1.bias"}));
      EXPECT_EQ(ddp.bucket_parameters(2), (std::vector<std::string>{"fc1.weight"}));
      EXPECT_EQ(ddp.bucket_parameters(3), (std::vector<std::string>{"conv.bias", "conv.weight"}));
      // When the first layer's gradient appears, backward has all of the convolution left to do.
      Clock::time_point conv_grad;
      net->conv->weight.register_hook([&conv_grad](const at::Tensor&) { conv_grad = Clock::now(); });
      for (int s = 0; s < 3; ++s) {
        auto [x, y] = data().slice(s, g.rank(), 2);
        F::cross_entropy(net->forward(x), y).backward();
        const Clock::time_point backward_done = Clock::now();
        ddp.synchronize();
        const auto events = ddp.take_bucket_events();
        ASSERT_EQ(events.size(), 4u);
        for (size_t b = 0; b < events.size(); ++b) {
          EXPECT_EQ(events[b].bucket, static_cast<int>(b));
          if (b > 0) {
            EXPECT_LE(events[b - 1].start, events[b].start);
          }
        }
        // With overlap the fully-connected layers' buckets start before the convolution's
        // gradient exists; without, every bucket starts after backward.
        if (overlap) {
          EXPECT_LT(events[2].start, conv_grad) << "step " << s;
        } else {
          EXPECT_GT(events[0].start, backward_done) << "step " << s;
        }
        net->zero_grad();
      }
    });
  }
}

// Net's layers registered out of the order forward uses them (fc2, conv, fc1; forward: conv,
// fc1, fc2), so reverse registration order is not the order backward produces gradients.
struct ScrambledImpl : torch::nn::Module {
  ScrambledImpl() {
    fc2 = register_module("fc2", torch::nn::Linear(32, kClasses));
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    fc1 = register_module("fc1", torch::nn::Linear(4 * 4 * 4, 32));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::max_pool2d(torch::relu(conv->forward(x)), 2);
    return fc2->forward(torch::relu(fc1->forward(h.flatten(1))));
  }
  torch::nn::Linear fc2{nullptr};
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc1{nullptr};
};
TORCH_MODULE(Scrambled);

std::set<std::string> names_of(const std::vector<std::string>& v) { return {v.begin(), v.end()}; }

TEST(LibtorchDdp, BucketsAreLaidOutAgainInTheOrderOfTheFirstBackward) {
  DdpOptions o;
  o.bucket_bytes = 350 * 4;
  o.record_events = true;
  for (bool rebuild : {true, false}) {
    o.rebuild_buckets = rebuild;
    run_ranks(2, [&](comm::Group& g) {
      Scrambled net = make_net<Scrambled>(0);
      DistributedDataParallel ddp(net, g, o);
      // Reverse registration: fc1 first, fc2 last.
      EXPECT_EQ(names_of(ddp.bucket_parameters(0)), (std::set<std::string>{"fc1.bias"}));
      EXPECT_EQ(names_of(ddp.bucket_parameters(ddp.num_buckets() - 1)), (std::set<std::string>{"fc2.weight"}));
      Clock::time_point conv_grad;
      net->conv->weight.register_hook([&conv_grad](const at::Tensor&) { conv_grad = Clock::now(); });
      for (int s = 0; s < 3; ++s) {
        auto [x, y] = data().slice(s, g.rank(), 2);
        F::cross_entropy(net->forward(x), y).backward();
        ddp.synchronize();
        const auto events = ddp.take_bucket_events();
        if (s == 0) continue;  // the first step ran on the registration layout
        if (rebuild) {
          // fc2's gradients come first: its bucket starts before the convolution's gradient exists.
          EXPECT_EQ(names_of(ddp.bucket_parameters(0)), (std::set<std::string>{"fc2.weight", "fc2.bias"}));
          const auto last = names_of(ddp.bucket_parameters(ddp.num_buckets() - 1));
          EXPECT_TRUE(last.count("conv.weight") == 1 && last.count("conv.bias") == 1);
          ASSERT_FALSE(events.empty());
          EXPECT_LT(events[0].start, conv_grad) << "step " << s;
        } else {
          EXPECT_EQ(names_of(ddp.bucket_parameters(0)), (std::set<std::string>{"fc1.bias"}));
        }
        net->zero_grad();
      }
    });
  }
  // The same math as one process, also across the rebuild (world 1: bit for bit).
  o.record_events = false;
  o.rebuild_buckets = true;
  const std::vector<at::Tensor> alone = train_alone<Scrambled>(kSteps);
  for (int world : {1, 2, 4}) {
    const auto ranks = train_ddp<Scrambled>(world, kSteps, o);
    for (int r = 1; r < world; ++r) {
      EXPECT_TRUE(bitwise_equal(ranks[static_cast<size_t>(r)], ranks[0])) << "world " << world << ", rank " << r;
    }
    const double diff = relative_difference(ranks[0], alone);
    if (world == 1) {
      EXPECT_EQ(diff, 0.0);
    } else {
      EXPECT_LE(diff, 1e-5) << "world " << world;
    }
  }
}

TEST(LibtorchDdp, TheRebuildCarriesTheCompressionStateAlong) {
  // PowerSGD works matrix by matrix: with its state renamed for the new layout, the rebuilt run
  // is the run that kept its first layout, bit for bit (0.077 apart with the state dropped).
  // bf16's error feedback is per element, but a rank's residual holds the result's rounding on
  // the block it owns, and ownership follows the layout: close, not equal (1.8e-4 measured,
  // 5e-4 with the state dropped).
  for (const auto& [compress, tol] : std::vector<std::pair<std::string, double>>{{"powersgd:2", 0.0}, {"bf16", 1e-3}}) {
    DdpOptions o;
    o.bucket_bytes = 350 * 4;
    o.compress = compress;
    o.rebuild_buckets = false;
    const auto kept = train_ddp<Scrambled>(2, 10, o);
    o.rebuild_buckets = true;
    const auto rebuilt = train_ddp<Scrambled>(2, 10, o);
    const double diff = relative_difference(rebuilt[0], kept[0]);
    std::printf("%s: rebuilt against kept layout: relative difference %.3g\n", compress.c_str(), diff);
    EXPECT_LE(diff, tol) << compress;
    EXPECT_TRUE(bitwise_equal(rebuilt[1], rebuilt[0])) << compress;
  }
}

// Three parameters that a loss may or may not use.
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    a = register_parameter("a", torch::ones({4}));
    b = register_parameter("b", torch::ones({4}));
    c = register_parameter("c", torch::ones({4}));  // never used
  }
  at::Tensor a, b, c;
};
TORCH_MODULE(TwoHeads);

TEST(LibtorchDdp, AParameterWithoutGradientCountsAsZeroWithoutAHang) {
  for (bool shared : {true, false}) {
    run_ranks(2, [&](comm::Group& g) {
      TwoHeads m;
      DdpOptions o;
      o.bucket_bytes = 16;  // one bucket each
      o.share_memory = shared;
      DistributedDataParallel ddp(m, g, o);
      for (int s = 0; s < 3; ++s) {
        at::Tensor loss = (m->a * 2.0f).sum();
        if (g.rank() == 0) loss = loss + (m->b * 4.0f).sum();
        loss.backward();
        ddp.synchronize();
        EXPECT_TRUE(m->a.grad().equal(torch::full({4}, 2.0f))) << "step " << s;
        EXPECT_TRUE(m->b.grad().equal(torch::full({4}, 2.0f))) << "step " << s << ": (4 + 0) / 2";
        EXPECT_TRUE(m->c.grad().equal(torch::zeros({4}))) << "step " << s;
        m->zero_grad();
      }
    });
  }
}

TEST(LibtorchDdp, CompressionKeepsRanksIdenticalNearTheF32RunWithFewerBytes) {
  constexpr int kCompressedSteps = 10;
  const std::vector<at::Tensor> alone = train_alone(kCompressedSteps);
  struct Case {
    std::string compress;
    double tol;        // largest relative difference to the f32 run (as DataParallel's test)
    double min_ratio;  // f32 bytes / wire bytes
  };
  for (const auto& [compress, tol, min_ratio] :
       std::vector<Case>{{"bf16", 2e-2, 1.9}, {"int8", 5e-2, 3.0}, {"powersgd:2", 0.3, 4.0}}) {
    std::vector<std::vector<at::Tensor>> out(2);
    std::vector<dtrain::parallel::CommVolume> volume(2);
    run_ranks(2, [&](comm::Group& g) {
      Net net = make_net(static_cast<uint64_t>(g.rank()));
      DdpOptions o;
      o.compress = compress;
      o.bucket_bytes = 1024;
      DistributedDataParallel ddp(net, g, o);
      auto sgd = make_sgd(net);
      for (int s = 0; s < kCompressedSteps; ++s) {
        auto [x, y] = data().slice(s, g.rank(), 2);
        F::cross_entropy(net->forward(x), y).backward();
        ddp.synchronize();
        sgd.step();
        sgd.zero_grad();
      }
      out[static_cast<size_t>(g.rank())] = snapshot(net);
      volume[static_cast<size_t>(g.rank())] = ddp.take_comm_volume();
    });
    EXPECT_TRUE(bitwise_equal(out[1], out[0])) << compress;
    const double diff = relative_difference(out[0], alone);
    const double ratio = static_cast<double>(volume[0].raw_bytes) / static_cast<double>(volume[0].wire_bytes);
    std::printf("%s: relative difference to f32 %.3g, f32 bytes / wire bytes %.2f\n", compress.c_str(), diff, ratio);
    EXPECT_LT(diff, tol) << compress;
    EXPECT_GT(diff, 0.0) << compress << " changed nothing";
    EXPECT_GE(ratio, min_ratio) << compress;
  }
}

// Runs fn on every rank of `world`; returns the dtrain::Error messages the ranks raised.
std::vector<std::string> errors_of(int world, const std::function<void(comm::Group&)>& fn) {
  std::mutex mu;
  std::vector<std::string> messages;
  try {
    run_ranks(world, [&](comm::Group& g) {
      try {
        fn(g);
      } catch (const dtrain::Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        messages.push_back(e.what());
        throw;
      }
    });
  } catch (const dtrain::Error&) {
  }
  return messages;
}

TEST(LibtorchDdp, MisuseGetsTheClearErrorsOfDataParallel) {
  // Ranks whose models differ: named on every rank, before any gradient moves.
  auto messages = errors_of(2, [](comm::Group& g) {
    torch::nn::Linear m(4, g.rank() == 0 ? 6 : 5);
    DistributedDataParallel ddp(m, g);
  });
  ASSERT_EQ(messages.size(), 2u);
  for (const auto& m : messages) EXPECT_NE(m.find("rank 1's model differs from rank 0's"), std::string::npos) << m;

  // A rank that skipped backward: every rank says who did and who did not.
  messages = errors_of(2, [](comm::Group& g) {
    Net net = make_net(0);
    DistributedDataParallel ddp(net, g);
    if (g.rank() == 0) {
      auto [x, y] = data().slice(0, 0, 2);
      F::cross_entropy(net->forward(x), y).backward();
    }
    ddp.synchronize();
  });
  ASSERT_EQ(messages.size(), 2u);
  for (const auto& m : messages) EXPECT_NE(m.find("rank 0: backward, rank 1: none"), std::string::npos) << m;

  // Backward twice with sync on: raised out of the second backward.
  messages = errors_of(1, [](comm::Group& g) {
    Net net = make_net(0);
    DistributedDataParallel ddp(net, g);
    for (int k = 0; k < 2; ++k) {
      auto [x, y] = data().slice(k, 0, 1);
      F::cross_entropy(net->forward(x), y).backward();
    }
  });
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_NE(messages[0].find("backward ran more than once"), std::string::npos) << messages[0];

  // Parameters and options it cannot take, named.
  messages = errors_of(1, [](comm::Group& g) {
    torch::nn::Linear m(torch::nn::LinearOptions(3, 2));
    m->to(torch::kDouble);
    DistributedDataParallel ddp(m, g);
  });
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_NE(messages[0].find("parameter 'weight' must be a dense contiguous float32 CPU tensor, is Double [2, 3]"),
            std::string::npos)
      << messages[0];
  messages = errors_of(1, [](comm::Group& g) {
    torch::nn::Linear m(3, 2);
    DdpOptions o;
    o.compress = "zstd";
    DistributedDataParallel ddp(m, g, o);
  });
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_NE(messages[0].find("--compress 'zstd'"), std::string::npos) << messages[0];
  messages = errors_of(1, [](comm::Group& g) { DistributedDataParallel ddp(nullptr, g); });
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_NE(messages[0].find("needs a module"), std::string::npos) << messages[0];
}

TEST(LibtorchDdp, AModelThatOutlivesItsDdpTrainsAlone) {
  Net net = make_net(0);
  run_ranks(1, [&](comm::Group& g) {
    DistributedDataParallel ddp(net, g);
    auto [x, y] = data().slice(0, 0, 1);
    F::cross_entropy(net->forward(x), y).backward();
    ddp.synchronize();
  });
  // The hooks are gone: two backward passes without synchronize() are fine now, and the
  // gradients (views of the freed DDP's buckets) accumulate.
  const at::Tensor before = net->fc2->bias.grad().clone();
  for (int k = 0; k < 2; ++k) {
    auto [x, y] = data().slice(k, 0, 1);
    F::cross_entropy(net->forward(x), y).backward();
  }
  EXPECT_FALSE(net->fc2->bias.grad().equal(before));
}

}  // namespace
