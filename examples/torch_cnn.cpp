// Example (c): a libtorch model (a small CNN written with PyTorch's C++ frontend) trained on
// Fashion-MNIST with dtrain's DistributedDataParallel. Links dtrain::torch.
//
//   dtrain launch -n 2 -- ./torch_cnn                   # 2 epochs, then the test accuracy
//   dtrain launch -n 4 -- ./torch_cnn --steps 50 --save params.pt   # torch.load() reads it
//   dtrain launch -n 1 -- ./torch_cnn --steps 50 --micro-batches 4 --save one.pt   # the same bits
//   mpirun -np 2 ./torch_cnn --steps 50
//   ./torch_cnn --bench 30 --batch-size 64              # samples/s after 5 warm-up steps
//
// Every global batch (--batch-size, default 64) is split between the ranks: rank r of N takes
// its r-th slice of N, optionally in --micro-batches K pieces whose gradients accumulate
// locally (no_sync) before the last one's backward synchronises them. The gradients are
// averaged across ranks, so every rank takes the same SGD step and a run on N processes is the
// one-process run of the same global batches: bit for bit against one process accumulating
// the same N slices (--micro-batches N) when N is a power of two, up to the order of float
// additions against one process taking each batch whole.
#include <dtrain/comm/group.h>
#include <dtrain/torch/ddp.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

using dtrain::comm::Group;

namespace {

// The model: conv 3x3 (32) -> ReLU -> conv 3x3 (64) -> ReLU -> max-pool 2 -> fc 128 -> ReLU ->
// fc 10. Modules are registered in the order forward uses them, so DDP's buckets (reverse
// registration order) follow the order backward produces the gradients.
struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)))),
        fc1(register_module("fc1", torch::nn::Linear(64 * 12 * 12, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}

  torch::Tensor forward(const torch::Tensor& images) {             // (B, 1, 28, 28)
    torch::Tensor x = torch::relu(conv1->forward(images));         // (B, 32, 26, 26)
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);      // (B, 64, 12, 12)
    return fc2->forward(torch::relu(fc1->forward(x.flatten(1))));  // (B, 10) logits
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Cnn);

// One gzip'd IDX file of (Fashion-)MNIST: a big-endian header (magic 0x0000080N, N sizes),
// then the unsigned bytes.
std::vector<uint8_t> read_idx(const std::string& path, std::vector<int64_t>& sizes) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) throw std::runtime_error(path + ": cannot open (Debian's dataset-fashion-mnist installs it)");
  auto u32 = [&] {
    unsigned char b[4];
    if (gzread(f, b, 4) != 4) throw std::runtime_error(path + ": truncated header");
    return uint32_t{b[0]} << 24 | uint32_t{b[1]} << 16 | uint32_t{b[2]} << 8 | uint32_t{b[3]};
  };
  const uint32_t magic = u32();
  if ((magic >> 8) != 0x08 || (magic & 0xff) == 0 || (magic & 0xff) > 4) {
    gzclose(f);
    throw std::runtime_error(path + ": not an IDX file of unsigned bytes");
  }
  int64_t count = 1;
  sizes.clear();
  for (uint32_t d = 0; d < (magic & 0xff); ++d) count *= sizes.emplace_back(u32());
  std::vector<uint8_t> bytes(static_cast<size_t>(count));
  const int got = gzread(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
  if (got != static_cast<int>(bytes.size())) throw std::runtime_error(path + ": truncated data");
  return bytes;
}

// Images (N, 1, 28, 28) normalised with Fashion-MNIST's mean and deviation, labels (N).
struct Split {
  torch::Tensor images, labels;
};

Split load(const std::string& dir, const std::string& prefix) {
  std::vector<int64_t> image_sizes, label_sizes;
  std::vector<uint8_t> pixels = read_idx(dir + "/" + prefix + "-images-idx3-ubyte.gz", image_sizes);
  std::vector<uint8_t> labels = read_idx(dir + "/" + prefix + "-labels-idx1-ubyte.gz", label_sizes);
  const int64_t n = image_sizes.at(0);
  Split s;
  s.images = torch::from_blob(pixels.data(), {n, 1, 28, 28}, torch::kUInt8).to(torch::kFloat).div_(255.0f);
  s.images.sub_(0.2860f).div_(0.3530f);
  s.labels = torch::from_blob(labels.data(), {n}, torch::kUInt8).to(torch::kLong);
  return s;
}

// `dtrain launch` sets RANK, WORLD_SIZE, MASTER_ADDR, ...; under mpirun the ranks meet through MPI.
Group join_world() {
  if (std::getenv("MASTER_ADDR") == nullptr && std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {
    return Group::from_mpi();
  }
  return Group::from_env();
}

struct Options {
  int epochs = 2;
  int steps = 0;            // > 0: stop after this many steps
  int bench = 0;            // > 0: time this many steps after 5 warm-up steps; no evaluation
  int64_t batch_size = 64;  // global; a multiple of the number of ranks
  int micro_batches = 1;    // per rank: gradient accumulation
  double lr = 0.05, momentum = 0.9;
  int threads = 1;  // libtorch's threads per process
  int log_every = 200;
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string save;  // rank 0 writes the final parameters here (torch.load reads them)
  dtrain::torch::DdpOptions ddp;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) throw std::runtime_error("option " + arg + " needs a value");
    const std::string value = argv[++i];
    if (arg == "--epochs") {
      o.epochs = std::stoi(value);
    } else if (arg == "--steps") {
      o.steps = std::stoi(value);
    } else if (arg == "--bench") {
      o.bench = std::stoi(value);
    } else if (arg == "--batch-size") {
      o.batch_size = std::stoll(value);
    } else if (arg == "--micro-batches") {
      o.micro_batches = std::stoi(value);
    } else if (arg == "--lr") {
      o.lr = std::stod(value);
    } else if (arg == "--momentum") {
      o.momentum = std::stod(value);
    } else if (arg == "--log-every") {
      o.log_every = std::stoi(value);
    } else if (arg == "--threads") {
      o.threads = std::stoi(value);
    } else if (arg == "--data") {
      o.data = value;
    } else if (arg == "--save") {
      o.save = value;
    } else if (arg == "--bucket-kb") {
      o.ddp.bucket_bytes = std::stoull(value) << 10;
    } else if (arg == "--compress") {
      o.ddp.compress = value;  // none, bf16, fp16, int8, int4, powersgd:RANK
    } else {
      throw std::runtime_error("unknown option " + arg +
                               " (expected --epochs, --steps, --bench, --batch-size, --micro-batches, --lr, "
                               "--momentum, --threads, --log-every, --data, "
                               "--save, --bucket-kb, --compress)");
    }
  }
  return o;
}

// The fraction of `test` classified correctly: each rank scores its share, the counts are
// summed across ranks.
double accuracy(Cnn& model, const Split& test, Group& world) {
  torch::NoGradGuard no_grad;
  const int64_t n = test.images.size(0), share = (n + world.size() - 1) / world.size();
  const int64_t begin = std::min(n, world.rank() * share), end = std::min(n, begin + share);
  int64_t counts[2] = {0, end - begin};  // correct, seen
  for (int64_t b = begin; b < end; b += 1000) {
    const int64_t len = std::min<int64_t>(1000, end - b);
    torch::Tensor predicted = model->forward(test.images.narrow(0, b, len)).argmax(1);
    counts[0] += predicted.eq(test.labels.narrow(0, b, len)).sum().item<int64_t>();
  }
  world.all_reduce(counts, counts, 2, dtrain::comm::DataType::i64, dtrain::comm::ReduceOp::sum);
  return static_cast<double>(counts[0]) / static_cast<double>(counts[1]);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines as they come, also through a pipe
  try {
    const Options opt = parse(argc, argv);
    torch::set_num_threads(opt.threads);
    Group world = join_world();
    const int rank = world.rank(), size = world.size();
    if (opt.batch_size <= 0 || opt.batch_size % size != 0) {
      throw std::runtime_error("--batch-size " + std::to_string(opt.batch_size) +
                               " is not a positive multiple of the " + std::to_string(size) + " ranks");
    }
    const Split train = load(opt.data, "train");
    const bool evaluate = opt.bench == 0 && opt.steps == 0;
    const Split test = evaluate ? load(opt.data, "t10k") : Split{};

    torch::manual_seed(static_cast<uint64_t>(rank));  // different on purpose: DDP broadcasts rank 0's
    Cnn model;
    dtrain::torch::DistributedDataParallel ddp(model, world, opt.ddp);  // rank 0's parameters everywhere, verified
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(opt.lr).momentum(opt.momentum));

    const int64_t per_rank = opt.batch_size / size, n = train.images.size(0);
    const int64_t steps_per_epoch = n / opt.batch_size;
    const int64_t total = opt.bench > 0 ? opt.bench + 5 : opt.steps > 0 ? opt.steps : opt.epochs * steps_per_epoch;
    std::vector<int64_t> order(static_cast<size_t>(n));
    auto started = std::chrono::steady_clock::now();
    for (int64_t step = 0; step < total; ++step) {
      const int64_t k = step % steps_per_epoch;
      if (k == 0) {  // a new epoch: every rank draws the same shuffled order
        std::iota(order.begin(), order.end(), int64_t{0});
        std::shuffle(order.begin(), order.end(), std::mt19937_64(static_cast<uint64_t>(step / steps_per_epoch)));
      }
      if (opt.bench > 0 && step == 5) started = std::chrono::steady_clock::now();
      // This rank's slice of the global batch, in `micro` micro-batches: the gradients of all
      // but the last accumulate locally (no_sync), the last backward synchronises them all.
      int64_t* slice = order.data() + k * opt.batch_size + rank * per_rank;
      const int64_t micro = per_rank / opt.micro_batches;
      double loss = 0.0;
      for (int m = 0; m < opt.micro_batches; ++m) {
        const torch::Tensor idx = torch::from_blob(slice + m * micro, {micro}, torch::kLong);
        torch::Tensor part = torch::nn::functional::cross_entropy(model->forward(train.images.index_select(0, idx)),
                                                                  train.labels.index_select(0, idx));
        loss += part.item<double>() / opt.micro_batches;
        if (m < opt.micro_batches - 1) {
          auto no_sync = ddp.no_sync();  // while it lives: accumulate locally, communicate nothing
          (part / opt.micro_batches).backward();
        } else {
          (part / opt.micro_batches).backward();  // each bucket starts its all_reduce as it fills
        }
      }
      ddp.synchronize();  // waits; param.grad() is now averaged over the ranks
      sgd.step();
      sgd.zero_grad();
      if (rank == 0 && opt.bench == 0 && (step % opt.log_every == 0 || step == total - 1)) {
        std::printf("step %ld/%ld: loss %.4f (rank 0's share of the batch)\n", static_cast<long>(step),
                    static_cast<long>(total), loss);
      }
      if (evaluate && k == steps_per_epoch - 1) {
        const double acc = accuracy(model, test, world);
        if (rank == 0)
          std::printf("epoch %ld: test accuracy %.4f\n", static_cast<long>(step / steps_per_epoch + 1), acc);
      }
    }
    if (opt.bench > 0 && rank == 0) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      std::printf("{\"world\": %d, \"per_rank_batch\": %ld, \"steps\": %d, \"samples_per_s\": %.2f}\n", size,
                  static_cast<long>(per_rank), opt.bench, static_cast<double>(opt.bench * opt.batch_size) / seconds);
    }
    if (!opt.save.empty() && rank == 0) {
      c10::Dict<std::string, torch::Tensor> params;
      for (const auto& p : model->named_parameters()) params.insert(p.key(), p.value().detach());
      const std::vector<char> bytes = torch::pickle_save(params);
      std::ofstream out(opt.save, std::ios::binary);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      if (!out.flush()) throw std::runtime_error("--save " + opt.save + ": cannot write");
      std::printf("saved the parameters to %s\n", opt.save.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_cnn: %s\n", e.what());
    return 1;
  }
}
