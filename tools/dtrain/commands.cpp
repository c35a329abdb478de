#include "commands.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "bench_gemm.h"
#include "dtrain/checkpoint/model_io.h"
#include "dtrain/comm/group.h"
#include "dtrain/comm/mpi.h"
#include "dtrain/core/error.h"
#include "dtrain/core/log.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/random.h"
#include "dtrain/train/trainer.h"

namespace dtrain::tools {

int run_train(train::TrainConfig& cfg, const std::vector<std::string>& argv) {
  train::finalize(cfg);
  // Started by mpirun / srun with --backend mpi, or by a launcher (RANK, or a world of the
  // requested size in Open MPI's, MPICH's or an srun step's environment): this process is one rank.
  const bool mpi = cfg.backend == "mpi";
  const comm::LauncherVars vars = comm::launcher_vars();
  const char* rank_env = vars.rank != nullptr ? std::getenv(vars.rank) : nullptr;
  const char* size_env = vars.size != nullptr ? std::getenv(vars.size) : nullptr;
  // Started as one of several workers (dtrain launch, torchrun; mpirun or srun with --backend
  // mpi) whose number is not this run's dp x pp x tp. Elastic (--min-workers): the launcher went
  // on with fewer workers after some could not come back; the data-parallel axis shrinks and the
  // global batch stays (the checkpoint reshards). Otherwise each worker would train on its own
  // and all would write the same files: without --dp the workers are the data-parallel replicas
  // (as torchrun users expect), with another --dp the two numbers are named.
  const bool launched = std::getenv("RANK") != nullptr || (mpi && rank_env != nullptr);
  if (launched && size_env != nullptr) {
    const long started = std::strtol(size_env, nullptr, 10);
    const int64_t want = static_cast<int64_t>(cfg.dp) * cfg.pp * cfg.tp;
    const int64_t per_replica = static_cast<int64_t>(cfg.pp) * cfg.tp;
    if (cfg.min_workers > 0 && started >= cfg.min_workers && started < want) {
      DT_CHECK(started % per_replica == 0, "train", "elastic: {} workers do not form whole replicas of pp {} x tp {}",
               started, cfg.pp, cfg.tp);
      const int dp = static_cast<int>(started / per_replica);
      if (cfg.deterministic) {
        // The micro-batch must stay what it was (docs/determinism.md): the fewer replicas
        // accumulate more of them, dp x accumulate kept.
        const int64_t per_step = static_cast<int64_t>(cfg.dp) * cfg.accumulate;
        DT_CHECK(per_step % dp == 0, "train",
                 "elastic --deterministic: --dp {} x --accumulate {} = {} micro-batches per step do not split over {} "
                 "replicas (the micro-batch must stay the same); choose dp x accumulate divisible by every world "
                 "size the job may shrink to",
                 cfg.dp, cfg.accumulate, per_step, dp);
        DT_LOG_WARN("elastic --deterministic: --accumulate {} instead of {} (the same micro-batches)", per_step / dp,
                    cfg.accumulate);
        cfg.accumulate = per_step / dp;
      }
      DT_CHECK(cfg.batch_size % (dp * cfg.accumulate * cfg.micro_batches) == 0, "train",
               "elastic: --batch-size {} does not split over {} replicas x --accumulate {} x --micro-batches {}",
               cfg.batch_size, dp, cfg.accumulate, cfg.micro_batches);
      DT_LOG_WARN("elastic: {} of {} workers, {} data-parallel replicas instead of {} (global batch {} kept)", started,
                  want, dp, cfg.dp, cfg.batch_size);
      cfg.dp = dp;
      if (dp == 1) cfg.zero = 0;
    } else if (started >= 1 && started != want) {
      DT_CHECK(cfg.given.count("dp") == 0 && started % per_replica == 0, "train",
               "the {} started {} workers ({}={}) but --dp {} x --pp {} x --tp {} = {}: give --dp {} or leave "
               "--dp out (the workers are then the data-parallel replicas), or run dtrain train --dp N without a "
               "launcher",
               std::getenv("RANK") != nullptr ? "launcher" : "MPI job (mpirun -np, srun -n)", started, vars.size,
               size_env, cfg.dp, cfg.pp, cfg.tp, want,
               started % per_replica == 0 ? fmt::format("{}", started / per_replica) : std::string("N"));
      cfg.dp = static_cast<int>(started / per_replica);
      train::finalize(cfg);  // the batch must split over the new dp
      if (rank_env == nullptr || std::string(rank_env) == "0") {
        std::fprintf(stderr, "dtrain train: %ld workers started by the launcher: --dp %d (data-parallel replicas)\n",
                     started, cfg.dp);
      }
    }
  }
  const bool in_world = std::getenv("RANK") != nullptr ||
                        (rank_env != nullptr && size_env != nullptr && std::atoi(size_env) == train::world_size(cfg));
  // Not started by a launcher: start dp x pp x tp copies of this very command.
  if (!mpi && (train::world_size(cfg) > 1 || cfg.max_restarts > 0) && !in_world) {
    return launch_self(train::world_size(cfg), argv, true, cfg.max_restarts, cfg.min_workers);
  }
  const train::TrainResult r = train::run_training(cfg);
  const bool lead = mpi && train::world_size(cfg) > 1
                        ? comm::mpi_world().rank == 0
                        : rank_env == nullptr || !in_world || std::string(rank_env) == "0";
  if (!lead) return 0;
  if (r.test_accuracy >= 0) {
    std::printf("final: steps %ld  train loss %.4f  test accuracy %.4f  %.1f samples/s  peak RSS %.1f MiB\n",
                static_cast<long>(r.steps), r.final_loss, r.test_accuracy, r.samples_per_s,
                static_cast<double>(r.peak_rss) / (1 << 20));
  } else {
    std::printf("final: steps %ld  train loss %.4f  val loss %.4f  %.0f tokens/s  peak RSS %.1f MiB\n",
                static_cast<long>(r.steps), r.final_loss, r.val_loss, r.tokens_per_s,
                static_cast<double>(r.peak_rss) / (1 << 20));
  }
  std::printf("params digest %s\n", r.params_digest.c_str());
  if (!cfg.save.empty()) std::printf("saved %s\n", cfg.save.c_str());
  return 0;
}

int run_diff(const DiffOptions& opts) {
  // NaN compares false with everything: `max_rel <= nan` would say EXCEEDS for identical models.
  DT_CHECK(std::isfinite(opts.tol) && opts.tol >= 0.0, "diff", "--tol {}: expected a finite non-negative number",
           opts.tol);
  const checkpoint::ModelFile a = checkpoint::load_model(opts.a);
  const checkpoint::ModelFile b = checkpoint::load_model(opts.b);
  const checkpoint::DiffResult d = checkpoint::diff_models(a, b);
  if (!opts.quiet) {
    std::printf("%-40s %14s %14s\n", "tensor", "max_abs", "rel");
    for (const auto& t : d.tensors) std::printf("%-40s %14.6e %14.6e\n", t.name.c_str(), t.max_abs, t.rel);
  }
  const bool ok = d.max_rel <= opts.tol;
  std::printf("overall: max_abs %.6e  max_rel %.6e  tol %.1e  %s\n", d.max_abs, d.max_rel, opts.tol,
              ok ? "WITHIN" : "EXCEEDS");
  return ok ? 0 : 1;
}

int launch_self(int n, const std::vector<std::string>& argv, bool prefix_output, int max_restarts, int min_workers) {
  char self[4096] = {};
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  DT_CHECK(len > 0, "launch", "cannot find this program's path (/proc/self/exe)");
  launch::LaunchOptions lo;
  lo.nproc_per_node = n;
  lo.prefix_output = prefix_output;
  lo.max_restarts = max_restarts;
  lo.min_workers = min_workers;
  lo.command.push_back(std::string(self, static_cast<size_t>(len)));
  lo.command.insert(lo.command.end(), argv.begin() + 1, argv.end());
  return tools::run_launch(lo);
}

void parse_nnodes(const std::string& text, launch::LaunchOptions& opts) {
  const size_t colon = text.find(':');
  auto number = [&](const std::string& part) {
    char* end = nullptr;
    const long v = std::strtol(part.c_str(), &end, 10);
    DT_CHECK(!part.empty() && *end == '\0' && v >= 1 && v <= 4096, "launch",
             "--nnodes '{}': expected N or MIN:MAX with 1 <= MIN <= MAX <= 4096", text);
    return static_cast<int>(v);
  };
  if (colon == std::string::npos) {
    opts.nnodes = number(text);
    return;
  }
  opts.min_nodes = number(text.substr(0, colon));
  opts.max_nodes = number(text.substr(colon + 1));
  DT_CHECK(opts.min_nodes <= opts.max_nodes, "launch", "--nnodes '{}': MIN is more than MAX", text);
}

int run_launch(const launch::LaunchOptions& options) {
  if (options.max_nodes > 0) return launch::run_elastic(options);
  launch::LaunchOptions opts = options;
  DT_CHECK(opts.max_restarts >= 0, "launch", "--max-restarts {} must be non-negative", opts.max_restarts);
  const int min_workers = opts.min_workers > 0 ? opts.min_workers : opts.nproc_per_node;
  DT_CHECK(min_workers <= opts.nproc_per_node, "launch", "--min-workers {} is more than -n {}", min_workers,
           opts.nproc_per_node);
  std::vector<int> failed_before;  // ranks that failed on the previous start
  for (int attempt = 0;; ++attempt) {
    // Workers see which start this is (fault injection fires on one attempt only).
    ::setenv("DTRAIN_RESTART", std::to_string(attempt).c_str(), 1);
    const auto t0 = std::chrono::steady_clock::now();
    const launch::LaunchResult r = launch::run_launch(opts);
    if (r.exit_code == 0) return 0;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Wall-clock time (as in the workers' log lines), so that detection can be measured.
    const auto now = std::chrono::system_clock::now();
    const std::time_t tt = std::chrono::system_clock::to_time_t(now);
    std::tm tm{};
    ::localtime_r(&tt, &tm);
    char stamp[32];
    std::strftime(stamp, sizeof(stamp), "%Y-%m-%d %H:%M:%S", &tm);
    const int ms =
        static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
    std::fprintf(stderr, "dtrain launch: [%s.%03d] job failed after %.1f s:\n%s", stamp, ms, s, r.report.c_str());
    if (attempt >= opts.max_restarts) return r.exit_code;
    // Elastic: a worker slot that failed on two starts in a row does not come back; with
    // --min-workers below -n the job goes on without it (workers resume from the checkpoint
    // in the smaller layout).
    const std::vector<int>& failed = r.first_failed;
    int lost = 0;
    for (int rank : failed) lost += std::count(failed_before.begin(), failed_before.end(), rank) > 0 ? 1 : 0;
    failed_before = failed;
    if (lost > 0 && opts.nproc_per_node - lost >= min_workers) {
      opts.nproc_per_node -= lost;
      failed_before.clear();
      std::fprintf(stderr,
                   "dtrain launch: %d worker%s failed on two starts in a row; continuing with %d workers "
                   "(--min-workers %d)\n",
                   lost, lost > 1 ? "s" : "", opts.nproc_per_node, min_workers);
    }
    std::fprintf(stderr, "dtrain launch: restarting all %d workers (restart %d of %d)\n", opts.nproc_per_node,
                 attempt + 1, opts.max_restarts);
    // The restarted workers record why and when the job failed (their metrics' start record,
    // which dtrain report marks on the run's timeline).
    ::setenv("DTRAIN_RESTART_REASON", (r.cause.empty() ? r.report.substr(0, r.report.find('\n')) : r.cause).c_str(), 1);
    ::setenv("DTRAIN_RESTART_FAILED_AT",
             std::to_string(std::chrono::duration<double>(now.time_since_epoch()).count()).c_str(), 1);
    ::setenv("DTRAIN_RESTART_FLIGHT_DIR", r.flight_dir.c_str(), 1);
  }
}

int run_bench_gemm(const BenchOptions& opts) { return run_bench_gemm(opts, GemmBenchOptions{}); }

}  // namespace dtrain::tools
