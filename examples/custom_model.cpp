// Example (b): a model of your own, written with dtrain's nn API, trained with data
// parallelism (dtrain::parallel::DataParallel) on Fashion-MNIST. Links dtrain::train.
//
//   dtrain launch -n 2 -- ./custom_model [--steps N] [--batch-size GLOBAL] [--data DIR]
//
// Each rank holds the whole model, runs forward and backward on its share of every global
// batch, and DataParallel averages the gradients across ranks (bucketed all_reduce started
// during backward), so every rank takes the same optimizer step.
#include <dtrain/comm/group.h>
#include <dtrain/data/data.h>
#include <dtrain/nn/layers.h>
#include <dtrain/nn/module.h>
#include <dtrain/optim/optim.h>
#include <dtrain/parallel/ddp.h>
#include <dtrain/tensor/autograd.h>
#include <dtrain/tensor/ops.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace nn = dtrain::nn;
namespace ops = dtrain::ops;
using dtrain::Tensor;
using dtrain::comm::Group;

namespace {

// One residual block: h + ReLU(Linear(LayerNorm(h))), width -> width.
class ResidualBlock : public nn::Module {
 public:
  ResidualBlock(int64_t width, dtrain::Generator& gen)
      : norm_(register_module("norm", std::make_shared<nn::LayerNorm>(width))),
        fc_(register_module("fc", std::make_shared<nn::Linear>(width, width, /*bias=*/true, gen))) {}
  Tensor forward(const Tensor& h) override { return h + ops::relu(fc_->forward(norm_->forward(h))); }

 private:
  std::shared_ptr<nn::LayerNorm> norm_;
  std::shared_ptr<nn::Linear> fc_;
};

// The model: images (B, 784) -> Linear to `width` -> `depth` residual blocks -> logits (B, 10).
// Modules are registered in the order forward uses them, so DataParallel's buckets (reverse
// registration order) follow the order backward produces the gradients.
class ResidualMlp : public nn::Module {
 public:
  ResidualMlp(int64_t width, int depth, uint64_t seed) : gen_(seed) {
    in_ = register_module("in", std::make_shared<nn::Linear>(784, width, true, gen_));
    for (int i = 0; i < depth; ++i) {
      blocks_.push_back(register_module("block" + std::to_string(i), std::make_shared<ResidualBlock>(width, gen_)));
    }
    out_ = register_module("out", std::make_shared<nn::Linear>(width, 10, true, gen_));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = ops::relu(in_->forward(x));
    for (auto& block : blocks_) h = block->forward(h);
    return out_->forward(h);
  }

 private:
  dtrain::Generator gen_;  // the initial values: rank 0's are broadcast anyway
  std::shared_ptr<nn::Linear> in_, out_;
  std::vector<std::shared_ptr<ResidualBlock>> blocks_;
};

// `dtrain launch` sets RANK, WORLD_SIZE, MASTER_ADDR, ...; under mpirun the ranks meet through MPI.
Group join_world() {
  if (std::getenv("MASTER_ADDR") == nullptr && std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {
    return Group::from_mpi();
  }
  return Group::from_env();
}

struct Options {
  int steps = 300;
  int64_t batch_size = 64;  // global: each of the N ranks takes batch_size / N samples
  std::string data = dtrain::data::FashionMnist::kDefaultDir;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) throw std::runtime_error("option " + arg + " needs a value");
    if (arg == "--steps") {
      o.steps = std::stoi(argv[++i]);
    } else if (arg == "--batch-size") {
      o.batch_size = std::stoll(argv[++i]);
    } else if (arg == "--data") {
      o.data = argv[++i];
    } else {
      throw std::runtime_error("unknown option " + arg + " (expected --steps, --batch-size, --data)");
    }
  }
  return o;
}

// The fraction of `test` this model classifies correctly; each rank scores its share and
// the counts are summed across ranks.
double accuracy(ResidualMlp& model, const dtrain::data::Dataset& test, Group& world) {
  dtrain::NoGradGuard no_grad;
  int64_t counts[2] = {0, 0};  // correct, seen
  for (int64_t begin = world.rank() * 1000; begin < test.size(); begin += world.size() * 1000) {
    std::vector<int64_t> idx;
    for (int64_t i = begin; i < std::min(begin + 1000, test.size()); ++i) idx.push_back(i);
    const dtrain::data::Batch batch = test.get(idx);
    const std::vector<float> logits = model.forward(batch.x).to_vector(), labels = batch.y.to_vector();
    for (size_t r = 0; r < labels.size(); ++r) {
      size_t best = 0;
      for (size_t c = 1; c < 10; ++c) best = logits[r * 10 + c] > logits[r * 10 + best] ? c : best;
      counts[0] += static_cast<float>(best) == labels[r];
    }
    counts[1] += static_cast<int64_t>(labels.size());
  }
  world.all_reduce(counts, counts, 2, dtrain::comm::DataType::i64, dtrain::comm::ReduceOp::sum);
  return static_cast<double>(counts[0]) / static_cast<double>(counts[1]);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines as they come, also through a pipe
  try {
    const Options opt = parse(argc, argv);
    Group world = join_world();
    const int rank = world.rank(), size = world.size();
    if (opt.batch_size % size != 0) {
      throw std::runtime_error("--batch-size " + std::to_string(opt.batch_size) + " is not a multiple of the " +
                               std::to_string(size) + " ranks");
    }
    dtrain::data::FashionMnist train(opt.data, /*train=*/true), test(opt.data, /*train=*/false);

    ResidualMlp model(/*width=*/128, /*depth=*/2, /*seed=*/1);
    dtrain::parallel::DataParallel ddp(model.named_parameters(), world);
    ddp.broadcast_parameters();  // rank 0's initial values on every rank, verified
    dtrain::optim::Sgd sgd(ddp.optimizer_params(), /*lr=*/0.05f, /*momentum=*/0.9f);

    // Every rank draws the same shuffled order and takes every size-th sample of it.
    const int64_t per_rank = opt.batch_size / size;
    dtrain::data::ShardedSampler sampler(train.size(), rank, size, /*seed=*/1);
    const int64_t steps_per_epoch = sampler.per_rank() / per_rank;
    std::vector<int64_t> order;
    for (int step = 0; step < opt.steps; ++step) {
      const int64_t k = step % steps_per_epoch;
      if (k == 0) order = sampler.indices(step / steps_per_epoch);  // a new epoch's order
      const std::vector<int64_t> idx(order.begin() + k * per_rank, order.begin() + (k + 1) * per_rank);
      const dtrain::data::Batch batch = train.get(idx);

      Tensor loss = ops::cross_entropy(model.forward(batch.x), batch.y);
      loss.backward();    // each finished bucket starts its all_reduce
      ddp.synchronize();  // waits; the gradients are now averaged over the ranks
      sgd.step();
      ddp.zero_grad();
      if (rank == 0 && (step % 100 == 0 || step == opt.steps - 1)) {
        std::printf("step %d: loss %.4f (rank 0's share of the batch)\n", step, loss.item());
      }
    }
    const double acc = accuracy(model, test, world);
    if (rank == 0) std::printf("test accuracy %.4f after %d steps on %d ranks\n", acc, opt.steps, size);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_model: %s\n", e.what());
    return 1;
  }
}
