// Example (a): dtrain's collectives alone. Links only dtrain::comm (buffers, counts and
// dtypes; no tensors, no models).
//
//   dtrain launch -n 4 -- ./comm_allreduce [COUNT]       # 4 processes on this host
//   mpirun -np 4 ./comm_allreduce [COUNT]                 # the same under MPI
//
// Every rank fills a buffer with rank + 1 and all-reduces it (sum): each element must then be
// 1 + 2 + ... + world. Then an asynchronous average that overlaps some local work, the way a
// training loop overlaps gradient communication with backward.
#include <dtrain/comm/group.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

using dtrain::comm::DataType;
using dtrain::comm::Group;
using dtrain::comm::ReduceOp;

namespace {

// `dtrain launch` (or torchrun) sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
// DTRAIN_SECRET; mpirun sets its own variables, and the ranks meet through MPI instead.
Group join_world() {
  if (std::getenv("MASTER_ADDR") == nullptr && std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {
    return Group::from_mpi();
  }
  return Group::from_env();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const size_t count = argc > 1 ? std::stoul(argv[1]) : size_t{1} << 20;
    if (count == 0) {
      std::fprintf(stderr, "comm_allreduce: COUNT must be at least 1, got %s\n", argv[1]);
      return 2;
    }
    Group world = join_world();
    const int rank = world.rank(), size = world.size();

    // Blocking all_reduce, in place: send and receive may be the same buffer.
    std::vector<float> buffer(count, static_cast<float>(rank + 1));
    world.all_reduce(buffer.data(), buffer.data(), count, DataType::f32, ReduceOp::sum);
    const float expected = static_cast<float>(size * (size + 1)) / 2.0f;
    for (size_t i = 0; i < count; ++i) {
      if (buffer[i] != expected) {
        std::fprintf(stderr, "rank %d: element %zu is %g, expected %g\n", rank, i, buffer[i], expected);
        return 1;
      }
    }

    // Asynchronous average: the buffer must stay alive and untouched until wait() returns.
    std::vector<double> values(count, static_cast<double>(rank));
    dtrain::comm::Work work = world.all_reduce_async(values.data(), values.data(), count, DataType::f64, ReduceOp::avg);
    double local = 0.0;  // stands for the work a program does meanwhile (a backward pass)
    for (size_t i = 0; i < count; ++i) local += static_cast<double>(i % 7);
    work.wait();  // throws dtrain::comm::CommError naming the rank that failed or timed out
    const double mean_rank = (size - 1) / 2.0;
    if (values[0] != mean_rank || values[count - 1] != mean_rank) {
      std::fprintf(stderr, "rank %d: average %g, expected %g\n", rank, values[0], mean_rank);
      return 1;
    }

    if (rank == 0) {
      std::printf(
          "all_reduce of %zu floats over %d ranks: every element is %g, as expected; average of the ranks %g "
          "(local work meanwhile: %g)\n",
          count, size, expected, mean_rank, local);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_allreduce: %s\n", e.what());
    return 1;
  }
}
