// A main() for libFuzzer-style targets built without libFuzzer (any compiler): runs the target
// over every file of the given corpus directories (or files), then over pseudo-random
// mutations of them (bit flips, interesting bytes and lengths, inserts, erases, splices,
// concatenations) until --iterations inputs or --seconds passed, whichever comes first.
// Deterministic for a given --seed. When the target crashes, the input is written to
// ./fuzz-crash.bin (replay it by passing that file).
//
//   store_frame_fuzz_replay [--seconds S] [--iterations N] [--seed X] [--max-len L] CORPUS...
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

using Bytes = std::vector<uint8_t>;

const Bytes* g_current = nullptr;

extern "C" void on_crash(int sig) {
  if (g_current != nullptr) {
    const int fd = ::open("fuzz-crash.bin", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      [[maybe_unused]] const ssize_t n = ::write(fd, g_current->data(), g_current->size());
      ::close(fd);
    }
    static const char msg[] = "replay: crashed; input written to fuzz-crash.bin\n";
    [[maybe_unused]] const ssize_t n = ::write(2, msg, sizeof(msg) - 1);
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void run(const Bytes& input) {
  g_current = &input;
  LLVMFuzzerTestOneInput(input.data(), input.size());
  g_current = nullptr;
}

// xorshift64*: small, fast and the same everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed == 0 ? 0x9e3779b97f4a7c15ull : seed) {}
  uint64_t next() {
    s_ ^= s_ >> 12;
    s_ ^= s_ << 25;
    s_ ^= s_ >> 27;
    return s_ * 0x2545f4914f6cdd1dull;
  }
  size_t below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(next() % n); }

 private:
  uint64_t s_;
};

void put_u32(Bytes& b, size_t at, uint32_t v) {
  for (size_t i = 0; i < 4 && at + i < b.size(); ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

void mutate(Bytes& b, const std::vector<Bytes>& corpus, Rng& rng, size_t max_len) {
  static constexpr uint8_t kBytes[] = {0x00, 0x01, 0x02, 0x06, 0x07, 0x7f, 0x80, 0xfe, 0xff};
  const uint32_t kLengths[] = {0u,
                               1u,
                               4u,
                               5u,
                               0x7fffffffu,
                               0xffffffffu,
                               16u << 20,
                               (16u << 20) + 1,
                               static_cast<uint32_t>(b.size()),
                               static_cast<uint32_t>(b.size() > 4 ? b.size() - 4 : 0)};
  const size_t steps = 1 + rng.below(4);
  for (size_t s = 0; s < steps; ++s) {
    switch (rng.below(9)) {
      case 0:
        if (!b.empty()) b[rng.below(b.size())] ^= static_cast<uint8_t>(1u << rng.below(8));
        break;
      case 1:
        if (!b.empty()) b[rng.below(b.size())] = kBytes[rng.below(sizeof(kBytes))];
        break;
      case 2:
        if (!b.empty()) put_u32(b, rng.below(b.size()), kLengths[rng.below(std::size(kLengths))]);
        break;
      case 3: {  // insert random bytes
        const size_t at = rng.below(b.size() + 1), n = 1 + rng.below(8);
        for (size_t i = 0; i < n; ++i)
          b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), static_cast<uint8_t>(rng.next()));
        break;
      }
      case 4: {  // erase a range
        if (b.empty()) break;
        const size_t at = rng.below(b.size()), n = 1 + rng.below(b.size() - at);
        b.erase(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + n));
        break;
      }
      case 5:  // truncate
        b.resize(rng.below(b.size() + 1));
        break;
      case 6: {  // splice: our prefix, another input's suffix
        const Bytes& other = corpus[rng.below(corpus.size())];
        b.resize(rng.below(b.size() + 1));
        const size_t from = rng.below(other.size() + 1);
        b.insert(b.end(), other.begin() + static_cast<std::ptrdiff_t>(from), other.end());
        break;
      }
      case 7: {  // concatenate another input (pipelined frames)
        const Bytes& other = corpus[rng.below(corpus.size())];
        b.insert(b.end(), other.begin(), other.end());
        break;
      }
      default:  // fresh random bytes
        b.resize(rng.below(64));
        for (auto& x : b) x = static_cast<uint8_t>(rng.next());
        break;
    }
  }
  if (b.size() > max_len) b.resize(max_len);
}

Bytes read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

[[noreturn]] void usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--seconds S] [--iterations N] [--seed X] [--max-len L] CORPUS...\n", argv0);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 3;
  uint64_t iterations = 100000, seed = 1;
  size_t max_len = 4096;
  std::vector<std::filesystem::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(argv[0]);
      return argv[++i];
    };
    if (arg == "--seconds") {
      seconds = std::strtod(value(), nullptr);
    } else if (arg == "--iterations") {
      iterations = std::strtoull(value(), nullptr, 10);
    } else if (arg == "--seed") {
      seed = std::strtoull(value(), nullptr, 10);
    } else if (arg == "--max-len") {
      max_len = std::strtoull(value(), nullptr, 10);
    } else if (!arg.empty() && arg[0] == '-') {
      usage(argv[0]);
    } else {
      inputs.emplace_back(arg);
    }
  }
  for (const int sig : {SIGABRT, SIGSEGV, SIGILL, SIGFPE, SIGBUS}) std::signal(sig, on_crash);

  std::vector<Bytes> corpus;
  for (const auto& p : inputs) {
    if (std::filesystem::is_directory(p)) {
      std::vector<std::filesystem::path> files;
      for (const auto& e : std::filesystem::directory_iterator(p)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
      std::sort(files.begin(), files.end());  // a deterministic order for a given seed
      for (const auto& f : files) corpus.push_back(read_file(f));
    } else if (std::filesystem::is_regular_file(p)) {
      corpus.push_back(read_file(p));
    } else {
      std::fprintf(stderr, "replay: no such corpus file or directory: %s\n", p.c_str());
      return 2;
    }
  }
  if (corpus.empty()) corpus.emplace_back();  // still fuzz from random bytes
  for (const auto& c : corpus) run(c);

  const auto start = std::chrono::steady_clock::now();
  const auto budget = std::chrono::duration<double>(seconds);
  Rng rng(seed);
  uint64_t done = 0;
  Bytes input;
  for (; done < iterations; ++done) {
    if ((done & 255) == 0 && std::chrono::steady_clock::now() - start > budget) break;
    input = corpus[rng.below(corpus.size())];
    mutate(input, corpus, rng, max_len);
    run(input);
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("replay: %zu corpus inputs and %llu mutated inputs in %.2f s (seed %llu): no crash\n", corpus.size(),
              static_cast<unsigned long long>(done), took, static_cast<unsigned long long>(seed));
  return 0;
}
