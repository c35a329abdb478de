// Helpers of the end-to-end tests: run the dtrain binary (DTRAIN_BINARY) as real processes,
// with a hard time limit, in a temporary directory of the test's own.
#pragma once

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

// An unnamed namespace, as before these moved here: the helper `dtrain()` shares its name with
// the library's namespace, which only an inner scope can hide.
namespace {  // NOLINT(google-build-namespaces)

namespace fs = std::filesystem;

struct ProcessResult {
  int code;
  std::string output;  // stdout and stderr
};

// Runs a shell command line; its stdout (add 2>&1 for stderr) and exit code.
inline ProcessResult run_shell(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  while (p != nullptr && fgets(buf.data(), buf.size(), p) != nullptr) out += buf.data();
  const int status = p != nullptr ? pclose(p) : -1;
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// Runs the dtrain binary with a hard time limit so a hang fails the test instead of CI.
inline ProcessResult dtrain(const std::string& args, int limit_s = 240) {
  return run_shell("timeout -k 5 " + std::to_string(limit_s) + " " + std::string(DTRAIN_BINARY) + " " + args + " 2>&1");
}

// Starts the dtrain binary in the background, its output going to `log`; returns its pid
// (a timeout wrapper that passes signals on to it).
inline pid_t dtrain_background(const std::string& args, const std::string& log, int limit_s = 240) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const std::string cmd = "exec timeout -k 5 " + std::to_string(limit_s) + " " + std::string(DTRAIN_BINARY) + " " +
                            args + " >" + log + " 2>&1";
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

inline int wait_code(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

inline std::string slurp(const std::string& file) {
  std::ifstream in(file);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Polls `file` until it contains `text` (true) or `limit` passed (false).
inline bool wait_for_text(const std::string& file, const std::string& text, std::chrono::seconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (slurp(file).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dtrain-cli-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    // Failed jobs keep their flight records: here, not in /tmp.
    ::setenv("DTRAIN_FLIGHT_DIR", dir_.c_str(), 1);
  }
  void TearDown() override {
    ::unsetenv("DTRAIN_FLIGHT_DIR");
    fs::remove_all(dir_);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path(name)) << text; }
  // A small English text corpus for GPT tests.
  std::string corpus() const {
    std::string text;
    for (int i = 0; i < 400; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    write("corpus.txt", text);
    return path("corpus.txt");
  }
  // Checkpoint moves: the SGD MLP run 8 steps in layout `from` (checkpoints every 4), resumed in
  // layout `to` up to step 12, must say which layout wrote it and end within 1e-5 of
  // path("ref.dtm"), the uninterrupted run's model (the caller trains it).
  struct LayoutMove {
    std::string from, to, written_by;
  };
  void expect_resumes_across_layouts(const std::string& mlp, const std::vector<LayoutMove>& cases,
                                     int limit_s = 240) const {
    for (size_t i = 0; i < cases.size(); ++i) {
      const std::string dir = path("r" + std::to_string(i)), out = path("r" + std::to_string(i) + ".dtm");
      ProcessResult a =
          dtrain(mlp + " " + cases[i].from + " --steps 8 --checkpoint-dir " + dir + " --checkpoint-every 4", limit_s);
      ASSERT_EQ(a.code, 0) << a.output;
      ProcessResult b =
          dtrain(mlp + " " + cases[i].to + " --steps 12 --checkpoint-dir " + dir + " --save " + out, limit_s);
      ASSERT_EQ(b.code, 0) << b.output;
      EXPECT_NE(b.output.find("8 steps done (written by " + cases[i].written_by + ")"), std::string::npos)
          << cases[i].from << " -> " << cases[i].to << ": " << b.output;
      ProcessResult d = dtrain("diff --tol 1e-5 --quiet " + path("ref.dtm") + " " + out);
      EXPECT_EQ(d.code, 0) << cases[i].from << " -> " << cases[i].to << ": " << d.output;
    }
  }
  nlohmann::json final_record(const std::string& metrics) const {
    std::ifstream in(path(metrics));
    std::string line, last;
    while (std::getline(in, line)) last = line;
    return nlohmann::json::parse(last);
  }
  fs::path dir_;
};

}  // namespace
