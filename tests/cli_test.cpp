// End-to-end tests of the dtrain tool: real processes, real data, small jobs.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "cli_util.h"
#include "dtrain/launch/launcher.h"

namespace fs = std::filesystem;

namespace {

class Cli : public CliTest {};

const char* kSmallMlp = "train --model mlp --hidden 64 --batch-size 32 --steps 60 --progress=false --log-every 20";

TEST_F(Cli, MlpTrainsAndWritesMetricsAndModel) {
  ProcessResult r = dtrain(std::string(kSmallMlp) + " --metrics " + path("m.jsonl") + " --save " + path("a.dtm"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("test accuracy"), std::string::npos) << r.output;
  nlohmann::json f = final_record("m.jsonl");
  EXPECT_EQ(f["event"], "final");
  EXPECT_EQ(f["steps"], 60);
  EXPECT_GT(f["test_accuracy"].get<double>(), 0.5);  // chance is 0.1
  EXPECT_GT(f["samples_per_s"].get<double>(), 0.0);
  EXPECT_GT(f["peak_rss_bytes"].get<int64_t>(), 1 << 20);
  EXPECT_EQ(f["params_digest"].get<std::string>().size(), 64u);
  EXPECT_TRUE(fs::exists(path("a.dtm")));
}

TEST_F(Cli, SameSeedIsBitwiseReproducibleAndDiffSaysSo) {
  ASSERT_EQ(dtrain(std::string(kSmallMlp) + " --seed 3 --save " + path("a.dtm") + " --metrics " + path("a.jsonl")).code,
            0);
  ASSERT_EQ(dtrain(std::string(kSmallMlp) + " --seed 3 --save " + path("b.dtm") + " --metrics " + path("b.jsonl")).code,
            0);
  EXPECT_EQ(final_record("a.jsonl")["params_digest"], final_record("b.jsonl")["params_digest"]);
  ProcessResult same = dtrain("diff " + path("a.dtm") + " " + path("b.dtm"));
  EXPECT_EQ(same.code, 0) << same.output;
  EXPECT_NE(same.output.find("max_rel 0.000000e+00"), std::string::npos) << same.output;

  ASSERT_EQ(dtrain(std::string(kSmallMlp) + " --seed 4 --save " + path("c.dtm")).code, 0);
  ProcessResult differ = dtrain("diff " + path("a.dtm") + " " + path("c.dtm"));
  EXPECT_EQ(differ.code, 1) << differ.output;
  EXPECT_NE(differ.output.find("EXCEEDS"), std::string::npos);
  EXPECT_EQ(dtrain("diff --tol 1e9 " + path("a.dtm") + " " + path("c.dtm")).code, 0);
}

TEST_F(Cli, GptTrainsOnTextAndLossFalls) {
  const std::string c = corpus();
  ProcessResult r = dtrain("train --model gpt --data text:" + c +
                           " --layers 2 --heads 2 --width 32 --seq-len 32 --batch-size 8 --lr 3e-3 --steps 80"
                           " --progress=false --log-every 20 --metrics " +
                           path("g.jsonl"));
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream in(path("g.jsonl"));
  std::string line;
  std::vector<double> losses;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == "log") losses.push_back(j["loss"].get<double>());
  }
  ASSERT_EQ(losses.size(), 4u);
  EXPECT_LT(losses.back(), losses.front() * 0.7) << "loss did not fall: " << losses.front() << " -> " << losses.back();
  nlohmann::json f = final_record("g.jsonl");
  EXPECT_GT(f["tokens_per_s"].get<double>(), 0.0);
  EXPECT_LT(f["val_loss"].get<double>(), 5.545);  // ln(256): better than uniform
}

TEST_F(Cli, ConfigFileCombinesWithFlagsAndFlagsWin) {
  write("c.toml", "model = \"mlp\"\nhidden = [32]\nbatch_size = 16\nsteps = 7\nlog_every = 7\nprogress = false\n");
  ProcessResult r = dtrain("train --config " + path("c.toml") + " --steps 5 --metrics " + path("m.jsonl"));
  ASSERT_EQ(r.code, 0) << r.output;
  nlohmann::json f = final_record("m.jsonl");
  EXPECT_EQ(f["steps"], 5);
  EXPECT_EQ(f["batch_size"], 16);
  EXPECT_EQ(f["params"], 784 * 32 + 32 + 32 * 10 + 10);
}

// Bad input: a clear message and a non-zero exit, never a crash or a hang.
struct BadInput {
  const char* name;
  std::string args;
  std::string expected;  // substring of the message
};

TEST_F(Cli, BadInputGetsClearErrors) {
  write("bad-type.toml", "batch_size = \"big\"\n");
  write("bad-key.toml", "batchsize = 3\n");
  write("bad-syntax.toml", "batch_size = = 3\n");
  write("empty.txt", "");
  fs::create_directory(path("badmnist"));
  for (const char* f : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                        "t10k-labels-idx1-ubyte.gz"}) {
    write("badmnist/" + std::string(f), "this is not gzip'd IDX data");
  }
  const std::vector<BadInput> cases = {
      {"unknown model", "train --model resnet", "expected mlp or gpt"},
      {"unknown flag", "train --bogus 3", "bogus"},
      {"missing data dir", "train --data fashion-mnist:" + path("nowhere"), "nowhere"},
      {"corrupt data files", "train --data fashion-mnist:" + path("badmnist"), "train-images-idx3-ubyte.gz"},
      {"missing text", "train --model gpt --data text:" + path("none.txt"), "none.txt"},
      {"empty corpus", "train --model gpt --data text:" + path("empty.txt"), "empty.txt"},
      {"malformed value", "train --batch-size abc", "batch-size"},
      {"negative batch", "train --batch-size -4", "batch-size"},
      {"heads do not divide width", "train --model gpt --width 30 --heads 4", "not divisible"},
      {"config wrong type", "train --config " + path("bad-type.toml"), "batch_size"},
      {"config unknown key", "train --config " + path("bad-key.toml"), "unknown key 'batchsize'"},
      {"config syntax", "train --config " + path("bad-syntax.toml"), "bad-syntax.toml:1"},
      {"diff missing file", "diff " + path("x.dtm") + " " + path("y.dtm"), "cannot open"},
  };
  for (const auto& c : cases) {
    ProcessResult r = dtrain(c.args, 60);
    EXPECT_NE(r.code, 0) << c.name << ": " << r.output;
    EXPECT_NE(r.code, -1) << c.name << " crashed or hung: " << r.output;
    EXPECT_LT(r.code, 128) << c.name << " died by a signal: " << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos)
        << c.name << ": '" << c.expected << "' not in: " << r.output;
  }
}

TEST_F(Cli, CorruptedModelFileIsRefused) {
  ASSERT_EQ(
      dtrain("train --model mlp --hidden 16 --batch-size 8 --steps 2 --progress=false --save " + path("a.dtm")).code,
      0);
  std::string bytes;
  {
    std::ifstream in(path("a.dtm"), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::string flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x40;
  std::ofstream(path("flipped.dtm"), std::ios::binary) << flipped;
  std::ofstream(path("short.dtm"), std::ios::binary) << bytes.substr(0, bytes.size() / 3);
  std::ofstream(path("foreign.dtm"), std::ios::binary) << "GIF89a this is not a model at all, padded to be long enough";

  ProcessResult r1 = dtrain("diff " + path("a.dtm") + " " + path("flipped.dtm"));
  EXPECT_EQ(r1.code, 2) << r1.output;
  EXPECT_NE(r1.output.find("checksum mismatch"), std::string::npos) << r1.output;
  ProcessResult r2 = dtrain("diff " + path("a.dtm") + " " + path("short.dtm"));
  EXPECT_EQ(r2.code, 2) << r2.output;
  EXPECT_NE(r2.output.find("short.dtm"), std::string::npos) << r2.output;
  ProcessResult r3 = dtrain("diff " + path("foreign.dtm") + " " + path("a.dtm"));
  EXPECT_EQ(r3.code, 2) << r3.output;
  EXPECT_NE(r3.output.find("not a dtrain model file"), std::string::npos) << r3.output;
}

}  // namespace

namespace {

// Every parallel layout against one process on the same global batch (SGD: the only difference
// is the order of float sums, so 1e-5 relative holds), and the figures each layout reports.
TEST_F(Cli, ParallelLayoutsEqualOneProcess) {
  const std::string gpt = "train --model gpt --data text:" + corpus() +
                          " --layers 2 --heads 4 --width 32 --seq-len 16 --batch-size 8 --steps 6 --optimizer sgd"
                          " --lr 0.05 --progress=false --log-every 3";
  ProcessResult one = dtrain(gpt + " --save " + path("one.dtm") + " --metrics " + path("one.jsonl"));
  ASSERT_EQ(one.code, 0) << one.output;
  const int64_t params = final_record("one.jsonl")["params"].get<int64_t>();
  const std::vector<std::string> layouts = {"--pp 2 --micro-batches 4", "--pp 4 --micro-batches 2 --schedule gpipe",
                                            "--tp 2", "--dp 2 --pp 2 --micro-batches 2",
                                            "--tp 2 --pp 2 --micro-batches 2 --stages 0-1,2-3"};
  for (size_t i = 0; i < layouts.size(); ++i) {
    const std::string name = "l" + std::to_string(i);
    ProcessResult r =
        dtrain(gpt + " " + layouts[i] + " --save " + path(name + ".dtm") + " --metrics " + path(name + ".jsonl"), 300);
    ASSERT_EQ(r.code, 0) << layouts[i] << ": " << r.output;
    ProcessResult d = dtrain("diff --tol 1e-5 --quiet " + path("one.dtm") + " " + path(name + ".dtm"));
    EXPECT_EQ(d.code, 0) << layouts[i] << ": " << d.output;
    nlohmann::json f = final_record(name + ".jsonl");
    EXPECT_EQ(f["params"].get<int64_t>(), params) << layouts[i] << ": the saved model is not the whole model";
    EXPECT_EQ(f["peak_rss_bytes_per_rank"].size(), static_cast<size_t>(f["world"].get<int>())) << layouts[i];
    const int pp = f["pp"].get<int>();
    if (pp > 1) {
      ASSERT_EQ(f["stage_bubble"].size(), static_cast<size_t>(pp)) << layouts[i];
      for (const auto& b : f["stage_bubble"]) {
        EXPECT_GE(b.get<double>(), 0.0);
        EXPECT_LT(b.get<double>(), 1.0);
      }
      EXPECT_GT(f["stage_activation_peak_bytes"][0].get<int64_t>(), 0) << layouts[i];
    }
  }
}

// Gradient clipping on every layout: the norm is over the whole model, whether the gradients
// sit in stages, tensor-parallel shards or ZeRO pieces, so every layout clips like one process.
TEST_F(Cli, ClippingOnEveryLayoutEqualsOneProcess) {
  const std::string gpt = "train --model gpt --data text:" + corpus() +
                          " --layers 2 --heads 4 --width 32 --seq-len 16 --batch-size 8 --steps 4 --optimizer sgd"
                          " --lr 0.05 --progress=false";
  ProcessResult one = dtrain(gpt + " --clip-grad 0.05 --save " + path("clip_one.dtm"));
  ASSERT_EQ(one.code, 0) << one.output;
  // The clip matters: without it the model ends elsewhere.
  ProcessResult free = dtrain(gpt + " --save " + path("clip_free.dtm"));
  ASSERT_EQ(free.code, 0) << free.output;
  EXPECT_NE(dtrain("diff --tol 1e-5 --quiet " + path("clip_one.dtm") + " " + path("clip_free.dtm")).code, 0)
      << "--clip-grad 0.05 did not change the run";
  const std::vector<std::string> layouts = {"--dp 2 --tp 2", "--dp 2 --tp 2 --zero 1",
                                            "--dp 2 --pp 2 --micro-batches 2 --zero 2",
                                            "--tp 2 --pp 2 --micro-batches 2 --stages 0-1,2-3"};
  for (size_t i = 0; i < layouts.size(); ++i) {
    const std::string name = "clip" + std::to_string(i) + ".dtm";
    ProcessResult r = dtrain(gpt + " --clip-grad 0.05 " + layouts[i] + " --save " + path(name), 300);
    ASSERT_EQ(r.code, 0) << layouts[i] << ": " << r.output;
    ProcessResult d = dtrain("diff --tol 1e-5 --quiet " + path("clip_one.dtm") + " " + path(name));
    EXPECT_EQ(d.code, 0) << layouts[i] << ": " << d.output;
  }
}

// Activation memory: with 1f1b a stage holds at most P micro-batches, with gpipe all M.
TEST_F(Cli, OneFOneBHoldsFewerActivationsThanGpipe) {
  const std::string gpt = "train --model gpt --data text:" + corpus() +
                          " --layers 2 --heads 4 --width 32 --seq-len 16 --batch-size 16 --steps 3 --pp 2"
                          " --micro-batches 8 --progress=false";
  std::map<std::string, nlohmann::json> f;
  for (const std::string sched : {"gpipe", "1f1b"}) {
    ProcessResult r = dtrain(gpt + " --schedule " + sched + " --metrics " + path(sched + ".jsonl"), 300);
    ASSERT_EQ(r.code, 0) << r.output;
    f[sched] = final_record(sched + ".jsonl");
  }
  EXPECT_EQ(f["gpipe"]["stage_max_in_flight"][0].get<int>(), 8);
  EXPECT_EQ(f["1f1b"]["stage_max_in_flight"][0].get<int>(), 2);
  EXPECT_EQ(f["1f1b"]["stage_max_in_flight"][1].get<int>(), 1);
  const double ratio = f["1f1b"]["stage_activation_peak_bytes"][0].get<double>() /
                       f["gpipe"]["stage_activation_peak_bytes"][0].get<double>();
  EXPECT_LE(ratio, 2.0 / 8.0 * 1.1) << "1f1b should hold 2 of gpipe's 8 micro-batches";
}

TEST_F(Cli, ModelParallelMisconfigurationIsRefusedBeforeAnyWork) {
  const std::string gpt = "train --model gpt --data text:" + corpus() + " --layers 2 --heads 4 --width 32 --seq-len 16";
  const std::vector<BadInput> cases = {
      {"more stages than blocks", gpt + " --pp 5", "--pp 5 stages but the gpt model has only 4 blocks"},
      {"heads not divisible by tp", gpt + " --tp 3", "--heads 4 is not divisible by --tp 3"},
      {"tensor parallel mlp", "train --model mlp --tp 2", "--model mlp has none"},
      {"micro-batches not dividing the batch", gpt + " --batch-size 16 --pp 2 --micro-batches 3",
       "is not divisible by --dp 1 x --accumulate 1 x --micro-batches 3"},
      {"micro-batches without stages", gpt + " --micro-batches 4", "needs pipeline stages"},
      {"unknown schedule", gpt + " --pp 2 --schedule zigzag", "expected gpipe or 1f1b"},
      {"stages that skip a block", gpt + " --pp 2 --stages 0-1,3-3", "must start at block 2"},
      {"stages not covering the model", gpt + " --pp 2 --stages 0-1,2-2", "the model has 4 blocks"},
      {"world does not match the layout", "launch -n 3 -- " + std::string(DTRAIN_BINARY) + " " + gpt + " --pp 2 --dp 2",
       "the launcher started 3 workers (WORLD_SIZE=3) but --dp 2 x --pp 2 x --tp 1 = 4"},
      {"model over the memory limit", gpt + " --memory-limit 100000", "but --memory-limit is"},
  };
  for (const auto& c : cases) {
    ProcessResult r = dtrain(c.args, 60);
    EXPECT_NE(r.code, 0) << c.name << ": " << r.output;
    EXPECT_LT(r.code, 128) << c.name << " died by a signal: " << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos)
        << c.name << ": '" << c.expected << "' not in: " << r.output;
    EXPECT_EQ(r.output.find("step 1"), std::string::npos) << c.name << ": training started: " << r.output;
  }
}

// The seed's "model does not fit on one device": refused on one process, trains split in stages.
TEST_F(Cli, AModelOverTheMemoryLimitTrainsWhenSplitIntoStages) {
  const std::string gpt = "train --model gpt --data text:" + corpus() +
                          " --layers 4 --heads 4 --width 32 --seq-len 16 --batch-size 8 --steps 2 --progress=false"
                          " --memory-limit 600000";
  ProcessResult one = dtrain(gpt);
  EXPECT_NE(one.code, 0);
  EXPECT_NE(one.output.find("split it with --pp or --tp"), std::string::npos) << one.output;
  ProcessResult two = dtrain(gpt + " --pp 2 --micro-batches 2");
  EXPECT_EQ(two.code, 0) << two.output;
}

// Nothing is lost: a worker killed mid-run (or mid-checkpoint) is restarted with the others
// from the last complete checkpoint, and the run ends with exactly the parameters of a run
// that never failed; a damaged newest checkpoint is skipped with a warning.
TEST_F(Cli, AKilledRunResumesFromItsCheckpointToTheSameParametersBitwise) {
  const std::string mlp = "train --model mlp --hidden 32 --batch-size 32 --steps 12 --progress=false --log-every 4";
  auto digest = [&](const std::string& metrics) { return final_record(metrics)["params_digest"].get<std::string>(); };
  ProcessResult ref = dtrain(mlp + " --dp 2 --metrics " + path("ref.jsonl"));
  ASSERT_EQ(ref.code, 0) << ref.output;
  struct Case {
    const char* name;
    std::string fault;
    std::string flags;
    std::string says = "resumed from";  // in the output (a restart resumes)
    bool restarts = true;
    const char* transport = "auto";
  };
  const std::vector<Case> cases = {
      {"kill rank 1 at step 7", "kill:rank=1:step=7"},
      {"rank 1 hangs (SIGSTOP) at step 7: only its missing heartbeats tell", "stop:rank=1:step=7",
       "--heartbeat-timeout 1", "rank 1 sent no heartbeat for"},
      {"rank 0 loses its network (every socket shut down) at step 6, over TCP", "drop:rank=0:step=6",
       "--heartbeat-timeout 1", "the connection", true, "tcp"},  // closed or reset, as the timing goes
      {"rank 1 straggles 1.5 s at step 5: slower, not failed", "delay:rank=1:step=5:ms=1500", "--heartbeat-timeout 1",
       "delaying this rank by 1500 ms", false},
      {"asynchronous checkpoints: step 4's commit came with step 8's save", "kill:rank=1:step=10",
       "--checkpoint-async=true"},
      {"kill rank 0 while it writes the step 8 checkpoint", "kill:rank=0:step=8:phase=checkpoint"},
      {"kill rank 1 while rank 0 is in the step 6 all_reduce", "kill:rank=1:step=6:phase=allreduce"},
      {"ZeRO-1 on one host (parameters in shared memory): kill rank 1 while rank 0 "
       "reduces the step 6 gradients",
       "kill:rank=1:step=6:phase=allreduce", "--zero 1"},
      {"two faults on two starts", "kill:rank=1:step=3,kill:rank=0:step=10:attempt=1"}};
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string dir = path("ckpt" + std::to_string(i)), metrics = path("f" + std::to_string(i) + ".jsonl");
    ::setenv("DTRAIN_FAULT", cases[i].fault.c_str(), 1);
    ::setenv("DTRAIN_TRANSPORT", cases[i].transport, 1);
    ProcessResult r = dtrain(mlp + " --dp 2 --checkpoint-dir " + dir + " --checkpoint-every 4 --max-restarts 2 " +
                                 cases[i].flags + " --metrics " + metrics,
                             300);
    ::unsetenv("DTRAIN_FAULT");
    ::unsetenv("DTRAIN_TRANSPORT");
    ASSERT_EQ(r.code, 0) << cases[i].name << ": " << r.output;
    EXPECT_EQ(r.output.find("restarting all 2 workers") != std::string::npos, cases[i].restarts)
        << cases[i].name << ": " << r.output;
    EXPECT_NE(r.output.find(cases[i].says), std::string::npos) << cases[i].name << ": " << r.output;
    // The report shows each surviving rank's flight record: the operation it was in.
    if (cases[i].restarts && cases[i].fault.starts_with("stop")) {
      EXPECT_NE(r.output.find("flight records ("), std::string::npos) << cases[i].name << ": " << r.output;
      // ZeRO 0 on one host averages its buckets with all_reduce_shared; elsewhere all_reduce.
      EXPECT_TRUE(r.output.find("failed all_reduce_shared #") != std::string::npos ||
                  r.output.find("failed all_reduce #") != std::string::npos)
          << cases[i].name << ": " << r.output;
    }
    EXPECT_EQ(digest("f" + std::to_string(i) + ".jsonl"), digest("ref.jsonl")) << cases[i].name;
  }
  // One process, no launcher: killed at step 10, run again by hand, it resumes from step 8.
  const std::string one = mlp + " --checkpoint-dir " + path("one") + " --checkpoint-every 4 --keep 2";
  ProcessResult ref1 = dtrain(mlp + " --metrics " + path("ref1.jsonl"));
  ASSERT_EQ(ref1.code, 0) << ref1.output;
  ::setenv("DTRAIN_FAULT", "kill:rank=0:step=10", 1);
  ProcessResult killed = dtrain(one);
  ::unsetenv("DTRAIN_FAULT");
  EXPECT_NE(killed.code, 0) << killed.output;
  ASSERT_TRUE(fs::exists(path("one/step-00000008/manifest.json")));
  // Damage the newest checkpoint: the resume must fall back to step 4 and say why.
  {
    std::fstream f(path("one/step-00000008/rank-0.dtm"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
  }
  ProcessResult resumed = dtrain(one + " --metrics " + path("one.jsonl"));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("step-00000008 is not usable: rank-0.dtm does not match its checksum"),
            std::string::npos)
      << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + path("one") + "/step-00000004"), std::string::npos) << resumed.output;
  EXPECT_EQ(digest("one.jsonl"), digest("ref1.jsonl"));
  // --keep 2: only the two newest complete checkpoints stay.
  EXPECT_FALSE(fs::exists(path("one/step-00000004")));
  EXPECT_TRUE(fs::exists(path("one/step-00000012/manifest.json")));
}

// --optimizer-state int8: AdamW's moments in 8 bits, in memory and in checkpoints (about 6 bytes
// per parameter with the f32 parameters, against 12); a killed run resumes to the same bits, two
// replicas equal one process accumulating their micro-batches, and ZeRO or SGD are refused.
TEST_F(Cli, Int8OptimizerStateResumesBitwiseAndIsAboutFourTimesSmaller) {
  const std::string mlp = "train --model mlp --hidden 32 --batch-size 32 --steps 12 --progress=false --log-every 4";
  const std::string q8 = mlp + " --optimizer-state int8";
  ASSERT_EQ(dtrain(mlp + " --metrics " + path("f32.jsonl")).code, 0);
  ProcessResult ref = dtrain(q8 + " --metrics " + path("ref.jsonl"));
  ASSERT_EQ(ref.code, 0) << ref.output;
  const nlohmann::json f32 = final_record("f32.jsonl"), f = final_record("ref.jsonl");
  EXPECT_EQ(f["optimizer_state"], "int8");
  EXPECT_EQ(f32["optimizer_state"], "f32");
  EXPECT_GE(f32["optimizer_state_bytes"].get<double>() / f["optimizer_state_bytes"].get<double>(), 3.9);
  EXPECT_NE(f["params_digest"], f32["params_digest"]);
  EXPECT_GT(f["test_accuracy"].get<double>(), 0.2);  // learning after 12 steps (chance is 0.1)
  EXPECT_NEAR(f["test_accuracy"].get<double>(), f32["test_accuracy"].get<double>(), 0.05);
  // Killed at step 10 and run again: it resumes from the step 8 checkpoint to the same bits.
  const std::string one = q8 + " --checkpoint-dir " + path("ckpt") + " --checkpoint-every 4";
  ::setenv("DTRAIN_FAULT", "kill:rank=0:step=10", 1);
  ProcessResult killed = dtrain(one);
  ::unsetenv("DTRAIN_FAULT");
  EXPECT_NE(killed.code, 0) << killed.output;
  const int64_t params = f["params"].get<int64_t>();
  ASSERT_TRUE(fs::exists(path("ckpt/step-00000008/rank-0.dtm")));
  EXPECT_LT(static_cast<int64_t>(fs::file_size(path("ckpt/step-00000008/rank-0.dtm"))), 7 * params);
  ProcessResult resumed = dtrain(one + " --metrics " + path("resumed.jsonl"));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + path("ckpt") + "/step-00000008"), std::string::npos)
      << resumed.output;
  EXPECT_EQ(final_record("resumed.jsonl")["params_digest"], f["params_digest"]);
  // Two replicas against one process accumulating the same two micro-batches.
  ProcessResult dp = dtrain(q8 + " --dp 2 --metrics " + path("dp.jsonl"), 300);
  ASSERT_EQ(dp.code, 0) << dp.output;
  ProcessResult acc = dtrain(q8 + " --accumulate 2 --metrics " + path("acc.jsonl"));
  ASSERT_EQ(acc.code, 0) << acc.output;
  EXPECT_EQ(final_record("dp.jsonl")["params_digest"], final_record("acc.jsonl")["params_digest"]);
  const std::vector<std::pair<std::string, std::string>> refused = {
      {" --dp 2 --zero 1", "--optimizer-state int8 with --zero 1 is not supported"},
      {" --optimizer sgd", "--optimizer-state int8 quantizes AdamW's moments; --optimizer sgd has none"}};
  for (const auto& [flags, says] : refused) {
    ProcessResult r = dtrain(q8 + flags);
    EXPECT_NE(r.code, 0) << flags;
    EXPECT_NE(r.output.find(says), std::string::npos) << flags << ": " << r.output;
  }
  ProcessResult bad = dtrain(mlp + " --optimizer-state int4");
  EXPECT_NE(bad.output.find("--optimizer-state 'int4': expected f32 or int8"), std::string::npos) << bad.output;
}

// --offload: AdamW's state in memory-mapped files gives the in-memory run's bits, and a kill -9 in
// the middle of an offloaded optimizer step (the state files half updated) resumes from the last
// checkpoint to the same bits, for both state formats.
TEST_F(Cli, OffloadedStateTrainsLikeMemoryAndAKillMidStepResumesBitwise) {
  const std::string mlp = "train --model mlp --hidden 32 --batch-size 32 --steps 12 --progress=false --log-every 4";
  for (const std::string state : {"f32", "int8"}) {
    const std::string run = mlp + " --optimizer-state " + state;
    ProcessResult ref = dtrain(run + " --metrics " + path(state + "-ref.jsonl"));
    ASSERT_EQ(ref.code, 0) << ref.output;
    const std::string off = run + " --offload " + path(state + "-state") + " --checkpoint-dir " +
                            path(state + "-ckpt") + " --checkpoint-every 4";
    ::setenv("DTRAIN_FAULT", "kill:rank=0:step=10:phase=optimizer", 1);
    ProcessResult killed = dtrain(off);
    ::unsetenv("DTRAIN_FAULT");
    EXPECT_NE(killed.code, 0) << killed.output;
    EXPECT_NE(killed.output.find("at step 10 in the middle of its optimizer step"), std::string::npos) << killed.output;
    ProcessResult resumed = dtrain(off + " --metrics " + path(state + "-off.jsonl"));
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("resumed from " + path(state + "-ckpt") + "/step-00000008"), std::string::npos)
        << resumed.output;
    const nlohmann::json f = final_record(state + "-off.jsonl");
    EXPECT_TRUE(f["offload"].get<bool>());
    EXPECT_EQ(f["params_digest"], final_record(state + "-ref.jsonl")["params_digest"]) << state;
  }
  ProcessResult sgd = dtrain(mlp + " --optimizer sgd --offload " + path("sgd"));
  EXPECT_NE(sgd.output.find("--offload streams AdamW's state; --optimizer sgd is not supported"), std::string::npos)
      << sgd.output;
}

// --compress: the gradients travel compressed (counted on the wire), the run still learns, and
// a codec that does not exist or PowerSGD with ZeRO is refused before anything starts.
TEST_F(Cli, CompressedGradientsSendFewerBytesAndStillTrain) {
  const std::string mlp = "train --model mlp --hidden 128 --batch-size 64 --steps 30 --dp 2 --progress=false";
  struct Case {
    std::string compress;
    double min_ratio;
  };
  for (const Case& c : std::vector<Case>{{"none", 1.0}, {"int8", 3.5}, {"int4", 7.0}, {"powersgd:4", 10.0}}) {
    const std::string metrics = path(c.compress.substr(0, 4) + ".jsonl");
    ProcessResult r = dtrain(mlp + " --compress " + c.compress + " --metrics " + metrics);
    ASSERT_EQ(r.code, 0) << c.compress << ": " << r.output;
    const nlohmann::json f = final_record(c.compress.substr(0, 4) + ".jsonl");
    EXPECT_EQ(f["compress"], c.compress);
    EXPECT_GE(f["compression_ratio"].get<double>(), c.min_ratio) << c.compress;
    EXPECT_LE(f["compression_ratio"].get<double>(), c.min_ratio * 1.5 + 100.0) << c.compress;
    EXPECT_GT(f["test_accuracy"].get<double>(), 0.5) << c.compress;
  }
  // Nothing lost: the error-feedback residuals (and PowerSGD's factors) are in the checkpoint,
  // so a killed compressed run resumes to exactly the parameters of the one that never stopped.
  for (const std::string compress : {"int8", "powersgd:2"}) {
    const std::string run = mlp + " --compress " + compress + " --log-every 10";
    const std::string tag = compress.substr(0, 4);
    ASSERT_EQ(dtrain(run + " --metrics " + path(tag + "-ref.jsonl")).code, 0);
    ::setenv("DTRAIN_FAULT", "kill:rank=1:step=17", 1);
    ProcessResult k = dtrain(run + " --checkpoint-dir " + path(tag + "-ck") +
                             " --checkpoint-every 5 --max-restarts 1 --metrics " + path(tag + "-k.jsonl"));
    ::unsetenv("DTRAIN_FAULT");
    ASSERT_EQ(k.code, 0) << k.output;
    EXPECT_NE(k.output.find("resumed from"), std::string::npos) << k.output;
    EXPECT_EQ(k.output.find("error feedback starts from zero"), std::string::npos) << k.output;
    EXPECT_EQ(final_record(tag + "-k.jsonl")["params_digest"], final_record(tag + "-ref.jsonl")["params_digest"])
        << compress;
  }
  ProcessResult bad = dtrain(mlp + " --compress int3");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("--compress 'int3': expected none, bf16, fp16, int8, int4 or powersgd:RANK"),
            std::string::npos)
      << bad.output;
  ProcessResult zero = dtrain(mlp + " --zero 1 --compress powersgd:2");
  EXPECT_NE(zero.code, 0);
  EXPECT_NE(zero.output.find("needs --zero 0"), std::string::npos) << zero.output;
}

// Dropout masks depend only on the step (and the replica), not on what ran before: a GPT with
// dropout killed mid-run resumes to exactly the parameters of the run that never stopped.
TEST_F(Cli, AResumedRunWithDropoutDrawsTheSameMasks) {
  const std::string plain = "train --model gpt --data text:" + corpus() +
                            " --layers 2 --heads 2 --width 16 --seq-len 8 --batch-size 8 --steps 8 --dp 2"
                            " --progress=false";
  const std::string gpt = plain + " --dropout 0.2";
  auto digest = [&](const std::string& metrics) { return final_record(metrics)["params_digest"].get<std::string>(); };
  ASSERT_EQ(dtrain(gpt + " --metrics " + path("ref.jsonl")).code, 0);
  ::setenv("DTRAIN_FAULT", "kill:rank=1:step=6", 1);
  ProcessResult r = dtrain(gpt + " --checkpoint-dir " + path("ck") +
                           " --checkpoint-every 2 --max-restarts 1 --metrics " + path("f.jsonl"));
  ::unsetenv("DTRAIN_FAULT");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_EQ(digest("f.jsonl"), digest("ref.jsonl"));
  // And the masks do change from step to step: without dropout the run ends elsewhere.
  ASSERT_EQ(dtrain(plain + " --metrics " + path("nodrop.jsonl")).code, 0);
  EXPECT_NE(digest("nodrop.jsonl"), digest("ref.jsonl"));
}

// A checkpoint written by one data-parallel / pipeline / ZeRO layout resumes in another, with
// the optimizer state (SGD momentum here) cut to the new layout: the result matches the
// uninterrupted run within float tolerance.
TEST_F(Cli, ACheckpointResumesInAnotherLayoutAndAShrunkWorldGoesOn) {
  const std::string mlp = "train --model mlp --hidden 64,64 --batch-size 48 --optimizer sgd --lr 0.05 --progress=false";
  ProcessResult ref = dtrain(mlp + " --dp 4 --steps 12 --save " + path("ref.dtm"));
  ASSERT_EQ(ref.code, 0) << ref.output;
  expect_resumes_across_layouts(mlp, {{"--dp 4", "--dp 2", "dp 4 x pp 1, zero 0"},
                                      {"--dp 2", "--dp 4", "dp 2 x pp 1, zero 0"},
                                      {"--dp 4 --zero 1", "--dp 2 --pp 2 --micro-batches 2", "dp 4 x pp 1, zero 1"},
                                      {"--dp 2 --pp 2 --micro-batches 2", "--dp 4 --zero 1", "dp 2 x pp 2, zero 0"},
                                      // One bucket per parameter: as many ZeRO pieces as parameters.
                                      {"--dp 2 --zero 1 --bucket-mb 0.0002", "--dp 4", "dp 2 x pp 1, zero 1"}});
  // Elastic: rank 3 dies on every start; after two starts in a row the launcher goes on with 3
  // workers, which resume the dp 4 checkpoint as 3 replicas with the same global batch.
  ::setenv("DTRAIN_FAULT", "kill:rank=3:step=6:attempt=any", 1);
  ProcessResult el = dtrain(mlp + " --dp 4 --steps 12 --checkpoint-dir " + path("el") +
                                " --checkpoint-every 4 --max-restarts 3 --min-workers 2 --save " + path("el.dtm"),
                            300);
  ::unsetenv("DTRAIN_FAULT");
  ASSERT_EQ(el.code, 0) << el.output;
  EXPECT_NE(el.output.find("continuing with 3 workers"), std::string::npos) << el.output;
  EXPECT_NE(el.output.find("3 data-parallel replicas instead of 4 (global batch 48 kept)"), std::string::npos)
      << el.output;
  ProcessResult de = dtrain("diff --tol 1e-5 --quiet " + path("ref.dtm") + " " + path("el.dtm"));
  EXPECT_EQ(de.code, 0) << de.output;
  // The same with a rank that hangs (SIGSTOP) on every start: the heartbeats find it, and it,
  // not the rank that noticed, is the worker dropped.
  ::setenv("DTRAIN_FAULT", "stop:rank=3:step=6:attempt=any", 1);
  ProcessResult hung = dtrain(
      mlp + " --dp 4 --steps 12 --checkpoint-dir " + path("hung") +
          " --checkpoint-every 4 --max-restarts 3 --min-workers 2 --heartbeat-timeout 1 --save " + path("hung.dtm"),
      300);
  ::unsetenv("DTRAIN_FAULT");
  ASSERT_EQ(hung.code, 0) << hung.output;
  EXPECT_NE(hung.output.find("rank 3 sent no heartbeats (stopped or hung): it is the failed worker"), std::string::npos)
      << hung.output;
  EXPECT_NE(hung.output.find("continuing with 3 workers"), std::string::npos) << hung.output;
  ProcessResult dh = dtrain("diff --tol 1e-5 --quiet " + path("ref.dtm") + " " + path("hung.dtm"));
  EXPECT_EQ(dh.code, 0) << dh.output;
  // Another model (or optimizer, or tensor-parallel size) is refused, naming both, and nothing
  // is trained (or pruned) next to the other run's checkpoints.
  ProcessResult bad = dtrain(
      "train --model mlp --hidden 32 --batch-size 48 --steps 12 --progress=false --checkpoint-dir " + path("r0"));
  EXPECT_NE(bad.code, 0) << bad.output;
  EXPECT_NE(bad.output.find("holds a checkpoint this run cannot continue: written with model"), std::string::npos)
      << bad.output;
}

// Elastic nodes: two node agents (--nnodes 1:2, 2 workers each) train with dp 4. Node 1 leaves
// (its agent is stopped) while the job runs: node 0 goes on alone with 2 workers from the last
// checkpoint. Node 1 comes back: node 0 stops its workers and the next round has 4 again. The
// result matches the run that never changed size. The faults only hold rank 0 at a known
// step (delay) so that the test knows when to act.
TEST_F(Cli, AnElasticJobShrinksWhenANodeLeavesAndGrowsWhenItReturns) {
  const std::string mlp =
      "train --model mlp --hidden 64,64 --batch-size 48 --optimizer sgd --lr 0.05 --steps 20 "
      "--progress=false --log-every 4";
  ProcessResult ref = dtrain(mlp + " --dp 4 --save " + path("ref.dtm"));
  ASSERT_EQ(ref.code, 0) << ref.output;
  ::setenv("DTRAIN_SECRET", "d93cce28a60d3493032702df14dff10fe69403b0b57f02bd7148e57957a4717a", 1);
  ::setenv("DTRAIN_FAULT", "delay:rank=0:step=10:ms=60000:attempt=0,delay:rank=0:step=14:ms=60000:attempt=1", 1);
  const std::string agent = "launch --nnodes 1:2 -n 2 --master-port " + std::to_string(free_port()) +
                            " --last-call 1 --max-restarts 3 --node-rank ";
  const std::string work = std::string(" -- ") + DTRAIN_BINARY + " " + mlp +
                           " --dp 4 --min-workers 2 --checkpoint-dir " + path("ck") + " --checkpoint-every 4 --save " +
                           path("el.dtm");
  const pid_t a0 = dtrain_background(agent + "0" + work, path("a0.log"));
  const pid_t a1 = dtrain_background(agent + "1" + work, path("a1.log"));
  pid_t a1_again = -1;
  const bool held =
      wait_for_text(path("a0.log"), "delaying this rank by 60000 ms at step 10", std::chrono::seconds(120));
  ::kill(a1, SIGTERM);  // node 1 leaves
  const int a1_code = wait_code(a1);
  const bool held_again =
      held && wait_for_text(path("a0.log"), "delaying this rank by 60000 ms at step 14", std::chrono::seconds(120));
  if (held_again) a1_again = dtrain_background(agent + "1" + work, path("a1b.log"));  // node 1 returns
  if (!held_again) ::kill(a0, SIGTERM);
  const int a0_code = wait_code(a0);
  const int a1_again_code = a1_again > 0 ? wait_code(a1_again) : -1;
  ::unsetenv("DTRAIN_FAULT");
  ::unsetenv("DTRAIN_SECRET");
  const std::string log0 = slurp(path("a0.log"));
  ASSERT_TRUE(held && held_again) << log0 << slurp(path("a1.log"));
  EXPECT_NE(a1_code, 0);
  EXPECT_EQ(a0_code, 0) << log0;
  EXPECT_EQ(a1_again_code, 0) << slurp(path("a1b.log"));
  EXPECT_NE(log0.find("round 0: 2 nodes (node ranks 0,1), this is node 0 of the round: ranks 0-1 of 4"),
            std::string::npos)
      << log0;
  // Node 0 learns it from the store ("node 1 left") or from its own workers (peers died),
  // whichever comes first.
  EXPECT_NE(log0.find("round 0 ended: "), std::string::npos) << log0;
  EXPECT_NE(log0.find("round 1: 1 node (node ranks 0), this is node 0 of the round: ranks 0-1 of 2"), std::string::npos)
      << log0;
  EXPECT_NE(log0.find("2 data-parallel replicas instead of 4 (global batch 48 kept)"), std::string::npos) << log0;
  EXPECT_NE(log0.find("round 1: 1 node asked to join"), std::string::npos) << log0;
  EXPECT_NE(log0.find("round 2: 2 nodes (node ranks 0,1)"), std::string::npos) << log0;
  EXPECT_NE(slurp(path("a1b.log")).find("this is node 1 of the round: ranks 2-3 of 4"), std::string::npos);
  ProcessResult d = dtrain("diff --tol 1e-5 --quiet " + path("ref.dtm") + " " + path("el.dtm"));
  EXPECT_EQ(d.code, 0) << d.output;
}

// Two hosts (network namespaces with their own addresses, scripts/netns-cluster), one worker
// each over TCP, rate-limited links: the run equals the one-host run over shared memory
// bitwise (dp 2: the sum of two terms is exact in any order; the compressed collective runs
// the same steps on either transport), uncompressed and with int8.
TEST_F(Cli, TwoNamespacedHostsTrainLikeOneHost) {
  // Network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); this project's machines run
  // the tests as root, so this runs in CI.
  if (::geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
  const std::string cluster = "t" + std::to_string(::getpid() % 100000);  // this run's namespaces only
  const std::string mlp = "train --model mlp --hidden 64 --batch-size 32 --steps 10 --dp 2 --progress=false";
  for (const std::string compress : {"none", "int8"}) {
    ProcessResult ref = dtrain(mlp + " --compress " + compress + " --save " + path("ref-" + compress + ".dtm"));
    ASSERT_EQ(ref.code, 0) << ref.output;
    const std::string out = path("hosts-" + compress + ".dtm");
    const std::string launch = std::string(DTRAIN_BINARY) +
                               " launch --nnodes 2 --node-rank $HOST --master-addr $MASTER_ADDR --master-port 29613 "
                               "-n 1 -- " +
                               DTRAIN_BINARY + " " + mlp + " --compress " + compress + " --save " + out;
    const std::string cmd =
        "DTRAIN_SECRET=5cf5bfceb6372fdcea17dc1ee2d9026d2f92c9b2c4686758faef73b956979823 timeout -k 5 240 " +
        std::string(DTRAIN_SOURCE_DIR) + "/scripts/netns-cluster --hosts 2 --rate 1gbit --name " + cluster +
        " -- sh -c '" + launch + "' 2>&1";
    const ProcessResult r = run_shell(cmd);
    ASSERT_EQ(r.code, 0) << compress << ": " << r.output;
    EXPECT_NE(r.output.find("[h0] [rank 0] saved"), std::string::npos) << r.output;
    ProcessResult d = dtrain("diff --tol 0 --quiet " + path("ref-" + compress + ".dtm") + " " + out);
    EXPECT_EQ(d.code, 0) << compress << ": " << d.output;
  }
  // Two processes per host: the gradients' all_reduce runs hierarchically (shm within a host,
  // TCP between them), summing in another order than one host's shm: same math within 1e-5.
  const std::string dp4 = "train --model mlp --hidden 64 --batch-size 32 --steps 10 --dp 4 --progress=false";
  ProcessResult ref = dtrain(dp4 + " --save " + path("ref-dp4.dtm"));
  ASSERT_EQ(ref.code, 0) << ref.output;
  const std::string launch = std::string(DTRAIN_BINARY) +
                             " launch --nnodes 2 --node-rank $HOST --master-addr $MASTER_ADDR --master-port 29614 "
                             "-n 2 -- " +
                             DTRAIN_BINARY + " " + dp4 + " --save " + path("hosts-dp4.dtm");
  const ProcessResult r =
      run_shell("DTRAIN_SECRET=5cf5bfceb6372fdcea17dc1ee2d9026d2f92c9b2c4686758faef73b956979823 timeout -k 5 240 " +
                std::string(DTRAIN_SOURCE_DIR) + "/scripts/netns-cluster --hosts 2 --rate 1gbit --name " + cluster +
                " -- sh -c '" + launch + "' 2>&1");
  ASSERT_EQ(r.code, 0) << r.output;
  ProcessResult d = dtrain("diff --tol 1e-5 --quiet " + path("ref-dp4.dtm") + " " + path("hosts-dp4.dtm"));
  EXPECT_EQ(d.code, 0) << d.output;
}

// The MPI backend: the same training started by mpirun instead of dtrain's launcher; DP with
// ZeRO and AdamW, DP x PP and DP x TP GPT. MPI reduces in another order than shm, so the
// comparison has the same-math tolerance (1e-5), not bitwise.
TEST_F(Cli, MpirunTrainsLikeTheLauncher) {
#ifndef DTRAIN_MPIRUN
  GTEST_SKIP() << "built without MPI";
#else
  const std::string gpt = "--model gpt --data text:" + path("corpus.txt") +
                          " --layers 2 --width 32 --heads 4 --seq-len 16 --batch-size 8 --steps 6";
  std::string corpus;
  for (int i = 0; i < 400; ++i) corpus += "the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
  write("corpus.txt", corpus);
  const std::vector<std::string> jobs = {
      "--model mlp --hidden 64,32 --batch-size 64 --steps 12 --dp 4 --zero 1 --optimizer adamw",
      "--model mlp --hidden 64,32 --batch-size 64 --steps 12 --dp 2 --pp 2 --micro-batches 2", gpt + " --dp 2 --tp 2"};
  for (size_t k = 0; k < jobs.size(); ++k) {
    const std::string ref = path("ref" + std::to_string(k) + ".dtm"), mpi = path("mpi" + std::to_string(k) + ".dtm");
    ProcessResult r = dtrain("train " + jobs[k] + " --progress=false --save " + ref);
    ASSERT_EQ(r.code, 0) << jobs[k] << ": " << r.output;
    const ProcessResult m = run_shell("timeout -k 5 240 " + std::string(DTRAIN_MPIRUN) + " -np 4 " + DTRAIN_BINARY +
                                      " train --backend mpi " + jobs[k] + " --progress=false --save " + mpi + " 2>&1");
    ASSERT_EQ(m.code, 0) << jobs[k] << ": " << m.output;
    EXPECT_NE(m.output.find("saved " + mpi), std::string::npos) << m.output;
    ProcessResult d = dtrain("diff --tol 1e-5 --quiet " + ref + " " + mpi);
    EXPECT_EQ(d.code, 0) << jobs[k] << ": " << d.output;
  }
  // A world of the wrong size is named, and every rank ends (MPI_Abort), not only the one.
  const ProcessResult bad = run_shell("timeout -k 5 120 " + std::string(DTRAIN_MPIRUN) + " -np 3 " + DTRAIN_BINARY +
                                      " train --backend mpi --model mlp --hidden 16 --batch-size 12 --steps 2 --dp 4 "
                                      "--progress=false 2>&1");
  EXPECT_NE(bad.code, 0) << bad.output;
  EXPECT_NE(bad.output.find("the MPI job (mpirun -np, srun -n) started 3 workers (OMPI_COMM_WORLD_SIZE=3) but --dp 4"),
            std::string::npos)
      << bad.output;
  // A rank killed in the gradients' all_reduce ends the job soon (mpirun stops the others),
  // and a stopped one within the heartbeat timeout (the others end it with MPI_Abort).
  for (const std::string fault : {"kill:rank=1:step=3:phase=allreduce", "stop:rank=2:step=3"}) {
    const auto t0 = std::chrono::steady_clock::now();
    const ProcessResult f =
        run_shell("DTRAIN_FAULT=" + fault + " timeout -k 5 120 " + std::string(DTRAIN_MPIRUN) + " -np 4 " +
                  DTRAIN_BINARY + " train --backend mpi " + jobs[0] + " --heartbeat-timeout 2 --progress=false 2>&1");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(f.code, 0) << fault << ": " << f.output;
    EXPECT_NE(f.code, 124) << fault << ": the job hung: " << f.output;
    EXPECT_LT(s, 60.0) << fault << ": " << f.output;
  }
#endif
}

// srun sets SLURM_PROCID / SLURM_NTASKS, not RANK / WORLD_SIZE: the workers take their ranks
// from there (here dtrain launch provides the store, and the script hides its variables).
TEST_F(Cli, RanksComeFromSlurmsEnvironment) {
  const std::string job = "--model mlp --hidden 32 --batch-size 16 --steps 4 --dp 2 --progress=false";
  ProcessResult ref = dtrain("train " + job + " --save " + path("ref.dtm"));
  ASSERT_EQ(ref.code, 0) << ref.output;
  const ProcessResult r = dtrain(
      "launch -n 2 -- sh -c 'SLURM_STEP_ID=0 SLURM_PROCID=$RANK SLURM_NTASKS=$WORLD_SIZE "
      "exec env -u RANK -u WORLD_SIZE " +
      std::string(DTRAIN_BINARY) + " train " + job + " --save " + path("slurm.dtm") + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0] saved"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[rank 1] saved"), std::string::npos) << "rank 1 acted as the lead: " << r.output;
  ProcessResult d = dtrain("diff --tol 0 --quiet " + path("ref.dtm") + " " + path("slurm.dtm"));
  EXPECT_EQ(d.code, 0) << d.output;
}

TEST(Launch, StartsWorkersWithTheirEnvironmentAndPrefixesOutput) {
  ProcessResult r = dtrain(
      "launch -n 3 -- sh -c 'echo id $RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE "
      "${#DTRAIN_SECRET} $MASTER_ADDR'",
      60);
  ASSERT_EQ(r.code, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string line = "[rank " + std::to_string(rank) + "] id " + std::to_string(rank) + "/3/" +
                             std::to_string(rank) + "/3 64 127.0.0.1";
    EXPECT_NE(r.output.find(line), std::string::npos) << line << " not in: " << r.output;
  }
}

// With no more workers than CPUs, local rank i runs on the i-th equal slice of the CPUs; with
// --bind none (or more workers than CPUs) on all of them; --bind core asks for what it can get.
TEST(Launch, BindsWorkersToDisjointCpusWhenTheyFit) {
  cpu_set_t mine;
  ASSERT_EQ(::sched_getaffinity(0, sizeof(mine), &mine), 0);
  const int cpus = CPU_COUNT(&mine);
  const std::string show = " -- sh -c 'echo cpus $(grep Cpus_allowed_list /proc/self/status | cut -f2)'";
  auto lists = [](const std::string& out) {
    std::vector<std::string> v;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);) {
      if (const auto at = line.find("cpus "); at != std::string::npos) v.push_back(line.substr(at + 5));
    }
    std::sort(v.begin(), v.end());
    return v;
  };
  ProcessResult none = dtrain("launch -n 2 --bind none" + show, 30);
  ASSERT_EQ(none.code, 0) << none.output;
  const std::vector<std::string> all = lists(none.output);
  ASSERT_EQ(all.size(), 2u) << none.output;
  EXPECT_EQ(all[0], all[1]) << none.output;
  ProcessResult bound = dtrain("launch -n 2" + show, 30);
  ASSERT_EQ(bound.code, 0) << bound.output;
  const std::vector<std::string> two = lists(bound.output);
  ASSERT_EQ(two.size(), 2u) << bound.output;
  if (cpus >= 2) {
    EXPECT_NE(two[0], two[1]) << "two workers on " << cpus << " CPUs share them: " << bound.output;
    EXPECT_NE(two[0], all[0]) << bound.output;
    // A bound worker still learns how many CPUs the job has (its waits depend on it).
    ProcessResult env = dtrain("launch -n 2 -- sh -c 'echo job_cpus=$DTRAIN_JOB_CPUS'", 30);
    EXPECT_NE(env.output.find("job_cpus=" + std::to_string(cpus / 2 * 2)), std::string::npos) << env.output;
  }
  ProcessResult many = dtrain("launch -n " + std::to_string(cpus + 1) + " --bind core -- true", 30);
  EXPECT_NE(many.code, 0);
  EXPECT_NE(many.output.find("only " + std::to_string(cpus) + " CPUs to bind them to"), std::string::npos)
      << many.output;
}

// Binding on an SMT machine numbered as Linux often does (siblings i and i + 4): workers get
// whole cores while they fit, and no core is split between two workers that could each have one.
TEST(Launch, BindingKeepsSmtSiblingsTogether) {
  using dtrain::launch::assign_cpus;
  using dtrain::launch::LogicalCpu;
  std::vector<LogicalCpu> smt;
  for (int id = 0; id < 8; ++id) smt.push_back({id, 0, id % 4});
  using Slices = std::vector<std::vector<int>>;
  EXPECT_EQ(assign_cpus(smt, 1), (Slices{{0, 4, 1, 5, 2, 6, 3, 7}}));
  EXPECT_EQ(assign_cpus(smt, 2), (Slices{{0, 4, 1, 5}, {2, 6, 3, 7}}));
  EXPECT_EQ(assign_cpus(smt, 3), (Slices{{0, 4}, {1, 5}, {2, 6}}));
  EXPECT_EQ(assign_cpus(smt, 4), (Slices{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(assign_cpus(smt, 8), (Slices{{0}, {4}, {1}, {5}, {2}, {6}, {3}, {7}}));
  EXPECT_TRUE(assign_cpus(smt, 9).empty());
  EXPECT_TRUE(assign_cpus(smt, 0).empty());
  // Two packages reuse core ids; CPUs without topology are cores of their own.
  EXPECT_EQ(assign_cpus({{0, 0, 0}, {1, 1, 0}}, 2), (Slices{{0}, {1}}));
  EXPECT_EQ(assign_cpus({{0, -1, -1}, {1, -1, -1}, {2, -1, -1}}, 3), (Slices{{0}, {1}, {2}}));
}

// Shared memory a worker created but never unlinked (killed before its peers mapped it) is
// removed by the launcher once the worker is gone; the names carry the creator's pid.
TEST(Launch, RemovesSharedMemoryADeadWorkerLeft) {
  ProcessResult r =
      dtrain("launch -n 1 -- sh -c 'echo pid $$; : > /dev/shm/dtrain-leaktest-$$-0123456789abcdef; kill -9 $$'", 30);
  EXPECT_NE(r.code, 0) << r.output;
  const auto at = r.output.find("pid ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string pid = r.output.substr(at + 4, r.output.find('\n', at) - at - 4);
  EXPECT_FALSE(fs::exists("/dev/shm/dtrain-leaktest-" + pid + "-0123456789abcdef")) << r.output;
}

TEST(Launch, OneFailingWorkerStopsTheRestAndIsReported) {
  const auto t0 = std::chrono::steady_clock::now();
  ProcessResult r = dtrain("launch -n 3 --grace 1 -- sh -c 'if [ $RANK = 1 ]; then exit 3; fi; sleep 60'", 60);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_LT(s, 20.0) << "the launcher did not stop the other workers";
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("after the launcher stopped it"), std::string::npos) << r.output;
}

TEST(Launch, BadOptionsAreRefusedBeforeStartingAnything) {
  ProcessResult r = dtrain("launch -n 0 -- true", 30);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("-n 0"), std::string::npos) << r.output;
  ProcessResult r2 = dtrain("launch -n 1 -- /nonexistent/program", 30);
  EXPECT_NE(r2.code, 0);
  EXPECT_NE(r2.output.find("cannot execute"), std::string::npos) << r2.output;
}

TEST(Plan, PredictsALayoutRecommendsOneAndRefusesImpossibleOnes) {
  // This machine, calibrated now: the prediction of a dp 2 x pp 2 run as JSON (stdout only).
  const ProcessResult j = run_shell("timeout -k 5 120 " + std::string(DTRAIN_BINARY) +
                                    " plan --model gpt --dp 2 --pp 2 --micro-batches 4 --calibrate --json 2>/dev/null");
  ASSERT_EQ(j.code, 0) << j.output;
  const nlohmann::json p = nlohmann::json::parse(j.output, nullptr, false);
  ASSERT_TRUE(p.is_object()) << j.output;
  EXPECT_GT(p["step_ms"].get<double>(), 0.0);
  EXPECT_NEAR(p["compute_ms"].get<double>() + p["exposed_comm_ms"].get<double>() + p["bubble_ms"].get<double>(),
              p["step_ms"].get<double>(), 1e-6 * p["step_ms"].get<double>());
  EXPECT_DOUBLE_EQ(p["bubble_theory"].get<double>(), 1.0 / 5.0);
  EXPECT_EQ(p["stages"].size(), 2u);
  EXPECT_GT(p["memory"]["activations"].get<double>(), 0.0);
  // Given devices: the search over layouts of a 1.3B GPT on 64 of them.
  const ProcessResult r =
      dtrain("plan --model gpt --params 1.3e9 --devices 64 --device-flops 9.9e14 --link-gbps 400 --memory 80e9", 120);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("recommended: --dp "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("memory per device: params "), std::string::npos) << r.output;
  const ProcessResult bad = dtrain("plan --model gpt --tp 3 --device-flops 1e12", 30);
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--heads 4 is not divisible by --tp 3"), std::string::npos) << bad.output;
  const ProcessResult none = dtrain("plan --model gpt --dp 2", 30);
  EXPECT_EQ(none.code, 2) << none.output;
  EXPECT_NE(none.output.find("no compute rate"), std::string::npos) << none.output;
  const ProcessResult tiny =
      dtrain("plan --model gpt --params 70e9 --devices 8 --device-flops 9.9e14 --memory 80e9", 60);
  EXPECT_EQ(tiny.code, 1) << tiny.output;
  EXPECT_NE(tiny.output.find("no layout of 8 devices fits"), std::string::npos) << tiny.output;
}

}  // namespace
