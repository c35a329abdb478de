// dtrain: the command-line tool. Subcommands: train, diff, launch, bench, plan, sweep, status, report.
#include <fmt/format.h>
#include <malloc.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "bench_gemm.h"
#include "commands.h"
#include "dtrain/comm/mpi.h"
#include "dtrain/core/error.h"
#include "dtrain/launch/launcher.h"
#include "plan_command.h"
#include "report_command.h"
#include "status_command.h"
#include "sweep_command.h"

namespace {

// A training step frees and allocates the same tensors again every step. glibc serves a block
// above its mmap threshold (128 KiB, rising to 32 MiB at most) with fresh pages from the kernel
// and returns them at free, so each step faults in and zeroes its large activations again:
// measured on the GPT (4 x 128, batch 16 x 128), 8267 tokens/s with glibc's defaults and 11111
// with blocks kept in the heap, gelu's 16 MiB output costing 3x its arithmetic. Keep blocks up to
// 1 GiB in the heap and trim it only past 2 GiB free; MALLOC_MMAP_THRESHOLD_ and
// MALLOC_TRIM_THRESHOLD_ in the environment still decide when set. Only this program: the
// library never changes the allocator of a process that links it.
void keep_freed_blocks() {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) ::mallopt(M_MMAP_THRESHOLD, 1 << 30);
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") == nullptr) ::mallopt(M_TRIM_THRESHOLD, INT32_MAX);
}

}  // namespace

// Only CLI11's ConstructionError can escape, while the options are declared: a programming error
// (e.g. a duplicate flag) that every run of dtrain would hit. Parse errors and every error of a
// run are caught below.
// NOLINTNEXTLINE(bugprone-exception-escape)
int main(int argc, char** argv) {
  keep_freed_blocks();
  CLI::App app{"dtrain: train neural networks across processes and machines"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "dtrain 0.1.0");

  dtrain::train::TrainConfig train_cfg;
  CLI::App* train = app.add_subcommand("train", "train a model (one process, or --dp N data-parallel processes)");
  dtrain::train::add_train_options(*train, train_cfg);

  dtrain::tools::DiffOptions diff_opts;
  CLI::App* diff = app.add_subcommand("diff", "compare two saved models; exit 0 when within --tol, 1 when not");
  diff->add_option("a", diff_opts.a, "first model file")->required();
  diff->add_option("b", diff_opts.b, "second model file")->required();
  diff->add_option("--tol", diff_opts.tol, "relative tolerance: max|a-b| / max|a| per tensor")->capture_default_str();
  diff->add_flag("--quiet", diff_opts.quiet, "print only the overall line");

  dtrain::launch::LaunchOptions launch_opts;
  CLI::App* launch =
      app.add_subcommand("launch", "start N local workers of a job: dtrain launch -n N -- PROGRAM ARGS...");
  launch->add_option("-n,--nproc-per-node", launch_opts.nproc_per_node, "workers on this node")->capture_default_str();
  std::string nnodes = "1";
  launch
      ->add_option("--nnodes", nnodes,
                   "nodes in the job: N, or MIN:MAX for an elastic job (nodes may leave and join; the workers "
                   "restart from their checkpoints in each new world)")
      ->capture_default_str();
  launch
      ->add_option("--last-call", launch_opts.last_call_seconds,
                   "elastic: once MIN nodes are in, seconds to wait for more before starting")
      ->capture_default_str();
  launch->add_option("--node-rank", launch_opts.node_rank, "this node's index (node 0 hosts the store)")
      ->capture_default_str();
  launch->add_option("--master-addr", launch_opts.master_addr, "address of node 0's store")->capture_default_str();
  launch->add_option("--master-port", launch_opts.master_port, "port of the store (0: any free port, one node only)")
      ->capture_default_str();
  launch->add_option("--grace", launch_opts.grace_seconds, "seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  launch
      ->add_option("--max-restarts", launch_opts.max_restarts,
                   "after a worker fails, start all workers again up to this many times (they resume from their "
                   "checkpoints; DTRAIN_RESTART tells them which start this is)")
      ->capture_default_str();
  launch
      ->add_option("--min-workers", launch_opts.min_workers,
                   "elastic: a worker that failed on two starts in a row is dropped while at least this many "
                   "remain (0: never)")
      ->capture_default_str();
  launch->add_option("--bind", launch_opts.bind,
                     "CPU binding: core (local rank i gets the i-th equal slice of the CPUs), none, or auto: core "
                     "when -n <= CPUs (default; also DTRAIN_BIND)");
  launch->add_option("command", launch_opts.command, "PROGRAM ARGS... (after --)")->required();

  dtrain::tools::BenchOptions bench_opts;
  CLI::App* bench = app.add_subcommand("bench", "micro-benchmarks");
  bench->require_subcommand(1);
  CLI::App* gemm = bench->add_subcommand(
      "gemm", "the core's measured FMA peak and each gemm library's GFLOP/s on the models' shapes (MFU denominators)");
  gemm->add_option("--size", bench_opts.size, "matrix size N (N x N x N)")->capture_default_str();
  gemm->add_option("--seconds", bench_opts.seconds, "time to measure per size")->capture_default_str();
  gemm->add_option("--threads", bench_opts.threads, "threads of both gemm libraries and of the peak probe")
      ->capture_default_str();
  dtrain::tools::GemmBenchOptions gemm_opts;
  gemm->add_option("--shapes", gemm_opts.shapes,
                   "models: the model shapes and a size grid (each library, the peak), then --size; square: only "
                   "--size")
      ->capture_default_str();
  gemm->add_option("--shape-seconds", gemm_opts.shape_seconds, "time per library and grid shape")
      ->capture_default_str();
  gemm->add_flag("--json", gemm_opts.json, "one JSON line per grid shape instead of the table");

  dtrain::tools::CollBenchOptions coll;
  CLI::App* colls = bench->add_subcommand(
      "collectives", "nccl-tests style sweep of one collective over message sizes on -n local processes");
  colls->add_option("-n,--nranks", coll.nranks, "ranks (processes) to launch")->capture_default_str();
  colls
      ->add_option("--op", coll.op,
                   "allreduce|allgather|reducescatter|broadcast|sendrecv|alltoall, or a comma-separated list (also "
                   "for --dtype, --redop, --algo: every combination runs)")
      ->capture_default_str();
  colls->add_option("--min-bytes,-b", coll.min_bytes, "smallest size (suffixes K, M, G)")->capture_default_str();
  colls->add_option("--max-bytes,-e", coll.max_bytes, "largest size (doubling from the smallest)")
      ->capture_default_str();
  colls->add_option("--counts", coll.counts,
                    "comma-separated element counts instead of the byte sweep (per-rank blocks for allgather, "
                    "reducescatter, alltoall)");
  colls->add_option("--dtype,-d", coll.dtype, "f32|bf16|f16|f64|i32|i64|u8")->capture_default_str();
  colls->add_option("--redop,-o", coll.redop, "sum|avg|max|min|prod")->capture_default_str();
  colls->add_option("--algo", coll.algo, "auto|direct|ring|hd|rd, or a comma-separated list (one sweep each)")
      ->capture_default_str();
  colls->add_option("--transport", coll.transport, "auto|shm|tcp, or mpi for ranks started by mpirun -np N")
      ->capture_default_str();
  colls->add_option("--compress", coll.compress,
                    "none|bf16|fp16|int8|int4, or a comma-separated list: the compressed allreduce / reducescatter "
                    "(f32, sum or avg) with effbw (f32 bytes) next to wirebw (bytes sent); --check then accepts "
                    "results within the derived error bound");
  colls->add_option("--iters,-i", coll.iters, "timed iterations per size")->capture_default_str();
  colls->add_option("--warmup,-w", coll.warmup, "untimed iterations per size")->capture_default_str();
  colls->add_option("--timeout", coll.timeout_s, "seconds before a collective gives up")->capture_default_str();
  colls->add_flag("--check,-c", coll.check, "verify the result of extra runs too (one run is always verified)");
  colls->add_flag("--inplace", coll.inplace, "all_reduce in place (send == recv)");
  colls->add_flag("--all-placements", coll.all_placements, "all_reduce both out of place and in place");
  colls->add_flag("--shared", coll.shared,
                  "all_reduce in place with each rank's vector in memory every rank maps (comm::allocate_shared, "
                  "all_reduce_shared: no copy in or out; shm transport)");
  colls->add_flag("--model", coll.model, "measure alpha/beta by ping-pong and print the cost model's time per row");
  colls->add_option("--json", coll.json, "write the results as JSON (rank 0)");

  dtrain::tools::PipeBenchOptions pipe_opts;
  CLI::App* pipe = bench->add_subcommand(
      "pipeline", "pipeline bubble per stage with exactly balanced stages on an emulated device, vs (P-1)/(M+P-1)");
  pipe->add_option("--stages,-n", pipe_opts.stages, "pipeline stages (processes)")->capture_default_str();
  pipe->add_option("--micro-batches,-m", pipe_opts.micro_batches, "micro-batches per step")->capture_default_str();
  pipe->add_option("--schedule", pipe_opts.schedule, "gpipe | 1f1b")->capture_default_str();
  pipe->add_option("--forward-us", pipe_opts.forward_us, "device time of one micro-batch's forward per stage")
      ->capture_default_str();
  pipe->add_option("--backward-us", pipe_opts.backward_us, "device time of its backward per stage")
      ->capture_default_str();
  pipe->add_option("--blocks", pipe_opts.blocks_per_stage, "blocks per stage (the time is split among them)")
      ->capture_default_str();
  pipe->add_option("--payload", pipe_opts.payload, "floats per activation / gradient message")->capture_default_str();
  pipe->add_option("--steps", pipe_opts.steps, "measured steps")->capture_default_str();
  pipe->add_option("--warmup", pipe_opts.warmup, "unmeasured steps first")->capture_default_str();
  pipe->add_flag("--json", pipe_opts.json, "also print the results as one JSON line");

  dtrain::tools::PlanOptions plan_opts;
  CLI::App* plan = app.add_subcommand(
      "plan", "predict step time, memory per device and scaling efficiency of a layout, or search the best one");
  dtrain::tools::add_plan_options(*plan, plan_opts);

  dtrain::tools::SweepOptions sweep_opts;
  CLI::App* sweep = app.add_subcommand("sweep", "hyperparameter search over dtrain train options: grid, random, asha");
  dtrain::tools::add_sweep_options(*sweep, sweep_opts);

  dtrain::tools::StatusOptions status_opts;
  CLI::App* status = app.add_subcommand(
      "status", "what every rank of a running job does now: step, operation and for how long, heartbeat, throughput");
  dtrain::tools::add_status_options(*status, status_opts);

  dtrain::tools::ReportOptions report_opts;
  CLI::App* report = app.add_subcommand(
      "report", "one self-contained HTML page of one or more runs: curves, time per rank, pipeline, faults");
  dtrain::tools::add_report_options(*report, report_opts);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (train->parsed()) {
      dtrain::train::apply_config_file(*train, train_cfg);
      return dtrain::tools::run_train(train_cfg, std::vector<std::string>(argv, argv + argc));
    }
    if (diff->parsed()) return dtrain::tools::run_diff(diff_opts);
    if (launch->parsed()) {
      dtrain::tools::parse_nnodes(nnodes, launch_opts);
      return dtrain::tools::run_launch(launch_opts);
    }
    if (gemm->parsed()) return dtrain::tools::run_bench_gemm(bench_opts, gemm_opts);
    if (colls->parsed()) return dtrain::tools::run_bench_collectives(coll, std::vector<std::string>(argv, argv + argc));
    if (pipe->parsed())
      return dtrain::tools::run_bench_pipeline(pipe_opts, std::vector<std::string>(argv, argv + argc));
    if (plan->parsed()) return dtrain::tools::run_plan(*plan, plan_opts, std::vector<std::string>(argv, argv + argc));
    if (sweep->parsed()) return dtrain::tools::run_sweep(*sweep, sweep_opts);
    if (status->parsed()) return dtrain::tools::run_status(status_opts);
    if (report->parsed()) return dtrain::tools::run_report(report_opts);
  } catch (const dtrain::Error& e) {
    std::fprintf(stderr, "dtrain: error: %s\n", e.what());
    std::fflush(stderr);
    dtrain::comm::mpi_abort_job(2);  // under mpirun: end every rank, not only this one
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain: error: %s\n", e.what());
    std::fflush(stderr);
    dtrain::comm::mpi_abort_job(2);
    return 2;
  }
  return 0;
}
