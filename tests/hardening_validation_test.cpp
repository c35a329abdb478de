// Inputs that were accepted and then misread (issue 28, validation gaps): integers wrapped into
// their option's type, a process count that overflowed, NaN and negative numbers, a diff
// tolerance of NaN or a directory as a model, checkpoint manifests and shards whose fields have
// the wrong type, checkpoint directories that cannot be listed or written, and two runs writing
// one checkpoint directory. Each gets an error that names the input, or (a damaged checkpoint)
// the previous complete one is used.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "cli_util.h"
#include "dtrain/checkpoint/checkpoint.h"
#include "dtrain/checkpoint/model_io.h"
#include "dtrain/core/error.h"

namespace {

using dtrain::checkpoint::Checkpointer;
using dtrain::checkpoint::CheckpointShard;

const std::string kMlp = "train --model mlp --hidden 32 --progress=false";

class HardeningValidation : public CliTest {
 protected:
  // Runs `args` and expects it to fail with `says` in its output.
  void refused(const std::string& args, const std::string& says) const {
    ProcessResult r = dtrain(args, 60);
    EXPECT_NE(r.code, 0) << args << ": " << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << args << ": " << r.output;
    EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << args << ": it trained: " << r.output;
  }
};

// The message of the dtrain::Error `f` throws ("" when it does not).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const dtrain::Error& e) {
    return e.message();
  }
  return {};
}

const nlohmann::json kLayout{{"model", "m"}, {"optimizer", "sgd"}, {"dp", 1}, {"pp", 1}, {"tp", 1}};

CheckpointShard shard_at(int64_t step) {
  CheckpointShard s;
  s.step = step;
  s.step_count = step;
  s.params.emplace_back("w", dtrain::Tensor::full({2, 3}, static_cast<float>(step)));
  s.optimizer.emplace_back("momentum/w", dtrain::Tensor::zeros({2, 3}));
  s.param_steps["w"] = step;
  return s;
}

// Writes checkpoints at steps 10 and 20 into `dir` (the Checkpointer is gone afterwards).
void two_checkpoints(const std::string& dir) {
  Checkpointer ck(dir, 3, nullptr, kLayout);
  ck.save(shard_at(10));
  ck.save(shard_at(20));
}

// ---- options ----

// `dp = 4294967297` in a config file ran one process; `--seed -1` was 2^64-1 and `--steps 010`
// was octal 8.
TEST_F(HardeningValidation, IntegersOutOfTheirOptionsTypeAreRefusedNamingKeyAndValue) {
  write("dp.toml", "dp = 4294967297\n");
  refused(kMlp + " --steps 1 --config " + path("dp.toml"),
          path("dp.toml") +
              ": key 'dp': 4294967297 is out of range (expected an integer from -2147483648 to "
              "2147483647)");
  write("keep.toml", "keep = -4294967295\n");
  refused(kMlp + " --steps 1 --config " + path("keep.toml"), "key 'keep': -4294967295 is out of range");
  refused(kMlp + " --steps 1 --dp 4294967297", "--dp: 4294967297 is out of range");
  refused(kMlp + " --steps 1 --seed -1", "--seed: '-1' is not a decimal integer");
  refused(kMlp + " --steps 99999999999999999999", "--steps: 99999999999999999999 is out of range");
  refused(kMlp + " --steps 1 --hidden 32,99999999999999999999", "--hidden: 99999999999999999999 is out of range");
  refused(kMlp + " --steps 0x10", "--steps: '0x10' is not a decimal integer");
  ProcessResult ten = dtrain(kMlp + " --steps 010", 60);
  ASSERT_EQ(ten.code, 0) << ten.output;
  EXPECT_NE(ten.output.find("final: steps 10 "), std::string::npos) << "010 read as octal: " << ten.output;
}

// --pp 65536 x --tp 65536 is 2^32 processes: as int, 0, which passed "at most 256".
TEST_F(HardeningValidation, ALayoutWhoseProcessCountOverflowsIsRefused) {
  refused("train --model gpt --layers 65534 --heads 65536 --width 65536 --pp 65536 --tp 65536 --steps 1",
          "--dp 1 x --pp 65536 x --tp 65536: each must be at least 1 and the product at most 256 processes");
  refused(kMlp + " --steps 1 --dp 2 --accumulate 4611686018427387904",
          "--accumulate 4611686018427387904 x --micro-batches 1 = more than 2^63");
}

// NaN, infinity and negatives where a number means nothing were accepted.
TEST_F(HardeningValidation, NonFiniteAndMeaninglessNumbersAreRefused) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--clip-grad nan", "--clip-grad nan: expected a finite number"},
      {"--lr inf", "--lr inf: expected a finite number"},
      {"--timeout nan", "--timeout nan: expected a finite number"},
      {"--weight-decay -1", "--weight-decay must be non-negative, got -1"},
      {"--warmup -5", "--warmup must be non-negative, got -5"},
      {"--min-workers -1", "--min-workers must be non-negative (0 = never shrink), got -1"},
      {"--eval-batches -1", "--eval-batches must be non-negative (0 = the whole split), got -1"},
      {"--clip-grad -1", "--clip-grad must be non-negative (0 = off), got -1"},
      {"--min-lr -0.5", "--min-lr must be non-negative, got -0.5"},
      {"--momentum 1", "--momentum 1 not in [0, 1)"},
      {"--beta1 -0.1", "--beta1 -0.1 not in [0, 1)"},
      {"--beta2 1.5", "--beta2 1.5 not in [0, 1)"},
      {"--eps 0", "--eps must be positive, got 0"},
      {"--bucket-mb 1e300", "--bucket-mb 1e+300 not in (0, 1048576]"},
      {"--timeout 1e300", "--timeout 1e+300 not in [0.001, 10000000] (seconds)"},
      {"--heartbeat-timeout -1", "--heartbeat-timeout -1: expected 0 (off) or [0.001, 10000000] (seconds)"},
      {"--epochs 9223372036854775807", "--epochs 9223372036854775807 is more than 1000000"},
      {"--hidden 32,-4", "--hidden width -4 not in [1, 16777216]"},
  };
  for (const auto& [flags, says] : cases) refused(kMlp + " --steps 1 " + flags, says);
  write("nan.toml", "clip_grad = nan\n");
  refused(kMlp + " --steps 1 --config " + path("nan.toml"),
          path("nan.toml") + ": key 'clip_grad': expected a finite number, got nan");
  write("big.toml", "lr = 1e300\n");
  refused(kMlp + " --steps 1 --config " + path("big.toml"), "key 'lr': 1e+300 is out of range");
}

// ---- dtrain diff ----

TEST_F(HardeningValidation, DiffRefusesANanToleranceAndNamesADirectory) {
  ASSERT_EQ(dtrain(kMlp + " --steps 2 --save " + path("a.dtm")).code, 0);
  ProcessResult ok = dtrain("diff " + path("a.dtm") + " " + path("a.dtm"));
  EXPECT_EQ(ok.code, 0) << ok.output;
  ProcessResult nan = dtrain("diff " + path("a.dtm") + " " + path("a.dtm") + " --tol nan");
  EXPECT_EQ(nan.code, 2) << nan.output;
  EXPECT_NE(nan.output.find("--tol nan: expected a finite non-negative number"), std::string::npos) << nan.output;
  ProcessResult neg = dtrain("diff " + path("a.dtm") + " " + path("a.dtm") + " --tol -1");
  EXPECT_NE(neg.output.find("--tol -1: expected a finite non-negative number"), std::string::npos) << neg.output;
  fs::create_directory(path("adir"));
  ProcessResult dir = dtrain("diff " + path("adir") + " " + path("a.dtm"));
  EXPECT_EQ(dir.code, 2) << dir.output;
  EXPECT_NE(dir.output.find(path("adir") + ": is a directory, not a model file"), std::string::npos) << dir.output;
  EXPECT_EQ(dir.output.find("basic_filebuf"), std::string::npos) << dir.output;
  const std::string msg = error_of([&] { dtrain::checkpoint::load_model("/dev/null"); });
  EXPECT_NE(msg.find("/dev/null: not a regular file"), std::string::npos) << msg;
}

// ---- damaged checkpoints ----

// The manifest parses but a field has the wrong type: it was a raw json type_error in the
// trainer (no file named, no fallback); now it is damage, and the step before is used.
TEST_F(HardeningValidation, AManifestWithFieldsOfTheWrongTypeFallsBackToTheCheckpointBefore) {
  const std::vector<std::pair<std::string, std::string>> breaks = {
      {"\"dp\": 1", "\"dp\": \"1\""},       {"\"pp\": 1", "\"pp\": 1.5"},
      {"\"tp\": 1", "\"tp\": null"},        {"\"dp\": 1", "\"dp\": 0"},
      {"\"dp\": 1", "\"dp\": 2"},  // two ranks, one file
      {"\"rank\": 0", "\"rank\": \"0\""},   {"\"name\": \"rank-0.dtm\"", "\"name\": \"rank-1.dtm\""},
      {"\"step\": 20", "\"step\": \"20\""},
  };
  for (size_t i = 0; i < breaks.size(); ++i) {
    const std::string dir = path("ck" + std::to_string(i));
    two_checkpoints(dir);
    const std::string manifest = dir + "/step-00000020/manifest.json";
    std::string text = slurp(manifest);
    const size_t at = text.find(breaks[i].first);
    ASSERT_NE(at, std::string::npos) << breaks[i].first << " in " << text;
    text.replace(at, breaks[i].first.size(), breaks[i].second);
    std::ofstream(manifest, std::ios::trunc) << text;
    EXPECT_FALSE(dtrain::checkpoint::checkpoint_damage(dir, 20, nlohmann::json::object()).empty()) << breaks[i].second;
    Checkpointer ck(dir, 3, nullptr, kLayout);
    const auto found = ck.latest(nlohmann::json{{"model", "m"}});
    ASSERT_TRUE(found.has_value()) << breaks[i].second;
    EXPECT_EQ(found->step, 10) << breaks[i].second;
  }
  // A directory where the manifest belongs: damage too, named.
  const std::string dir = path("ckdir");
  two_checkpoints(dir);
  fs::remove(dir + "/step-00000020/manifest.json");
  fs::create_directory(dir + "/step-00000020/manifest.json");
  EXPECT_EQ(dtrain::checkpoint::checkpoint_damage(dir, 20, nlohmann::json::object()), "manifest.json: is a directory");
  Checkpointer ck(dir, 3, nullptr, kLayout);
  EXPECT_EQ(ck.latest(nlohmann::json::object())->step, 10);
}

// The reported case end to end: the warning names the step's manifest, the run resumes from
// the checkpoint before and finishes.
TEST_F(HardeningValidation, ATrainingRunSkipsAManifestWithAStringDp) {
  const std::string job = kMlp + " --checkpoint-dir " + path("ck") + " --checkpoint-every 10";
  ASSERT_EQ(dtrain(job + " --steps 20").code, 0);
  const std::string manifest = path("ck/step-00000020/manifest.json");
  std::string text = slurp(manifest);
  const size_t at = text.find("\"dp\": 1");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, 7, "\"dp\": \"1\"");
  std::ofstream(manifest, std::ios::trunc) << text;
  ProcessResult r = dtrain(job + " --steps 30");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoint " + path("ck") +
                          "/step-00000020 is not usable: manifest.json: layout field "
                          "\"dp\" is \"1\", expected an integer from 1 to 256"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("resumed from " + path("ck") + "/step-00000010"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("type_error"), std::string::npos) << r.output;
}

// A shard whose checksum matches (so written as it is) but whose metadata has a field of the
// wrong type: damage, not a json type_error from read().
TEST_F(HardeningValidation, AShardWithMetadataOfTheWrongTypeFallsBackToTheCheckpointBefore) {
  const std::vector<std::pair<std::string, nlohmann::json>> breaks = {{"step_count", "x"},
                                                                      {"param_steps", nlohmann::json{{"w", "many"}}},
                                                                      {"params", -1},
                                                                      {"rank", "0"},
                                                                      {"step", 20.5}};
  for (size_t i = 0; i < breaks.size(); ++i) {
    const std::string dir = path("ck" + std::to_string(i));
    two_checkpoints(dir);
    const std::string shard = dir + "/step-00000020/rank-0.dtm";
    dtrain::checkpoint::ModelFile file = dtrain::checkpoint::load_model(shard);
    nlohmann::json meta = nlohmann::json::parse(file.metadata);
    meta[breaks[i].first] = breaks[i].second;
    file.metadata = meta.dump();
    const std::string bytes = dtrain::checkpoint::encode_model(file);
    dtrain::write_file_atomic(shard, bytes);
    const std::string manifest = dir + "/step-00000020/manifest.json";
    nlohmann::json m = nlohmann::json::parse(slurp(manifest));
    m["files"][0]["sha256"] = dtrain::checkpoint::sha256_hex(bytes.data(), bytes.size());
    std::ofstream(manifest, std::ios::trunc) << m.dump(1);
    const std::string damage = dtrain::checkpoint::checkpoint_damage(dir, 20, nlohmann::json::object());
    EXPECT_NE(damage.find("rank-0.dtm: its metadata"), std::string::npos) << breaks[i].first << ": " << damage;
    Checkpointer ck(dir, 3, nullptr, kLayout);
    const auto found = ck.latest(nlohmann::json::object());
    ASSERT_TRUE(found.has_value()) << breaks[i].first;
    EXPECT_EQ(found->step, 10) << breaks[i].first;
    EXPECT_EQ(ck.read(10, 0).step_count, 10);
    // Read directly, the shard is an error naming it.
    const std::string msg = error_of([&] { ck.read(20, 0); });
    EXPECT_NE(msg.find(shard + ": its metadata"), std::string::npos) << breaks[i].first << ": " << msg;
  }
}

// ---- checkpoint directories ----

// A directory that could not be listed read as empty: the run started over from step 0 (and
// would prune what it could not see). One that could not be written failed at the first
// checkpoint. (As root: a file in place of the directory, a path under a file, /proc.)
TEST_F(HardeningValidation, ACheckpointDirThatCannotBeListedOrWrittenIsRefusedAtStart) {
  write("afile", "x");
  refused(kMlp + " --steps 20 --checkpoint-every 10 --checkpoint-dir " + path("afile"),
          "--checkpoint-dir " + path("afile") + ": exists and is not a directory");
  refused(kMlp + " --steps 20 --checkpoint-every 10 --checkpoint-dir " + path("afile/ck"),
          "--checkpoint-dir " + path("afile/ck") + ": cannot create it: Not a directory");
  refused(kMlp + " --steps 20 --checkpoint-every 10 --checkpoint-dir /proc",
          "--checkpoint-dir /proc: cannot write in it");
  // The listing itself: an error naming the directory; a directory not made yet has no steps.
  const std::string msg = error_of([&] { dtrain::checkpoint::checkpoint_steps(path("afile")); });
  EXPECT_NE(msg.find("checkpoint dir " + path("afile") + ": cannot list it: Not a directory"), std::string::npos)
      << msg;
  EXPECT_TRUE(dtrain::checkpoint::checkpoint_steps(path("not-yet")).empty());
  // A new directory is created (with its parents), and a run in it works.
  ProcessResult made = dtrain(kMlp + " --steps 10 --checkpoint-every 10 --checkpoint-dir " + path("new/ck"));
  EXPECT_EQ(made.code, 0) << made.output;
  EXPECT_TRUE(fs::exists(path("new/ck/step-00000010/manifest.json")));
}

// One directory, one run: the second is told which process has it; a killed run's lock goes
// with it, so its restart takes the directory again.
TEST_F(HardeningValidation, TwoRunsNeverWriteOneCheckpointDir) {
  {
    Checkpointer first(path("ck"), 3, nullptr, kLayout);
    const std::string msg = error_of([&] { Checkpointer second(path("ck"), 3, nullptr, kLayout); });
    EXPECT_NE(
        msg.find("checkpoint dir " + path("ck") + " is in use by another run (pid " + std::to_string(::getpid()) + ")"),
        std::string::npos)
        << msg;
  }
  EXPECT_EQ(error_of([&] { Checkpointer again(path("ck"), 3, nullptr, kLayout); }), "");

  const std::string job = kMlp + " --checkpoint-dir " + path("run") + " --checkpoint-every 50";
  const pid_t bg = dtrain_background(job + " --steps 1000000", path("bg.log"));
  // Its pid in the lock file: the lock is held.
  long holder = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (holder == 0 && std::chrono::steady_clock::now() < until) {
    holder = std::atol(slurp(path("run/.lock")).c_str());
    if (holder == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GT(holder, 0) << slurp(path("bg.log"));
  refused(job + " --steps 100",
          "checkpoint dir " + path("run") + " is in use by another run (pid " + std::to_string(holder) + ")");
  refused(job + " --steps 100 --dp 2",
          "checkpoint dir " + path("run") + " is in use by another run (pid " + std::to_string(holder) + ")");
  ASSERT_TRUE(wait_for_text(path("bg.log"), "step 100", std::chrono::seconds(60))) << slurp(path("bg.log"));
  ::kill(static_cast<pid_t>(holder), SIGKILL);
  wait_code(bg);
  // Killed: the kernel released its lock; the same job starts again and resumes.
  EXPECT_EQ(error_of([&] { Checkpointer again(path("run"), 3, nullptr, kLayout); }), "");
  const std::vector<int64_t> steps = dtrain::checkpoint::checkpoint_steps(path("run"));
  ASSERT_FALSE(steps.empty());
  ProcessResult resumed = dtrain(job + " --steps " + std::to_string(steps.front() + 10));
  EXPECT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + path("run")), std::string::npos) << resumed.output;
  // A symlink planted at the lock's name is not followed (it would truncate its target).
  write("victim", "keep me");
  fs::create_directory(path("planted"));
  fs::create_symlink(path("victim"), path("planted/.lock"));
  const std::string msg = error_of([&] { Checkpointer c(path("planted"), 3, nullptr, kLayout); });
  EXPECT_NE(msg.find(path("planted/.lock") + ": is a symbolic link"), std::string::npos) << msg;
  EXPECT_EQ(slurp(path("victim")), "keep me");
}

}  // namespace
