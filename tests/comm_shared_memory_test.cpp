// Group::allocate_shared, reduce_scatter_shared_async and all_reduce_shared: memory every rank
// of a one-host group maps, and the collectives that read (and write) their vectors there in place. Checked against the
// copying reduce_scatter bit for bit, with the errors a caller can run into.
#include <dirent.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "comm_test_util.h"
#include "dtrain/comm/group.h"
#include "dtrain/comm/shared.h"

namespace dtrain::comm {
namespace {

using test_util::quick_options;
using test_util::run_ranks;

int shm_entries_containing(const std::string& needle) {
  int found = 0;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(dir)) found += std::strstr(e->d_name, needle.c_str()) != nullptr;
    ::closedir(dir);
  }
  return found;
}

TEST(SharedMemory, EveryRankSeesEveryRanksWritesAfterABarrier) {
  for (int world : {1, 2, 3, 5}) {
    run_ranks(world, [&](Group& g) {
      ASSERT_TRUE(can_share_memory(g));
      constexpr size_t kPerRank = 4099;  // not a multiple of anything
      SharedMemory m = allocate_shared(g, kPerRank * static_cast<size_t>(world));
      ASSERT_TRUE(m.valid());
      ASSERT_EQ(m.bytes(), kPerRank * static_cast<size_t>(world));
      for (size_t i = 0; i < m.bytes(); ++i) ASSERT_EQ(m.data()[i], 0) << "not zeroed at byte " << i;
      g.barrier();  // nobody writes before everyone checked the zeros
      char* mine = m.data() + static_cast<size_t>(g.rank()) * kPerRank;
      for (size_t i = 0; i < kPerRank; ++i) mine[i] = static_cast<char>(g.rank() * 31 + static_cast<int>(i % 7));
      g.barrier();
      for (int q = 0; q < world; ++q) {
        const char* theirs = m.data() + static_cast<size_t>(q) * kPerRank;
        for (size_t i = 0; i < kPerRank; ++i) {
          ASSERT_EQ(theirs[i], static_cast<char>(q * 31 + static_cast<int>(i % 7)))
              << "rank " << g.rank() << " reads rank " << q << "'s byte " << i;
        }
      }
      // A second allocation is a different block; the first stays mapped.
      SharedMemory other = allocate_shared(g, 64);
      EXPECT_NE(other.data(), m.data());
      EXPECT_EQ(m.data()[0], 0);
      g.barrier();
    });
  }
}

TEST(SharedMemory, NothingIsLeftInDevShm) {
  run_ranks(3, [](Group& g) {
    SharedMemory m = allocate_shared(g, 1 << 20);
    // The name is unlinked as soon as every rank mapped it: no file survives a crash. Only
    // this process's segments count (their names carry its pid): ctest -j runs other test
    // processes whose first groups have the same names.
    g.barrier();
    EXPECT_EQ(shm_entries_containing(fmt::format("_mem0-{}-", ::getpid())), 0);
    m.data()[g.rank()] = 1;
  });
}

template <typename T>
void fill(std::vector<T>& v, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-8.0, 8.0);
  for (auto& x : v) x = static_cast<T>(u(rng));
}

TEST(SharedMemory, ReduceScatterInPlaceEqualsTheCopyingOneBitwise) {
  for (int world : {1, 2, 3, 5}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::prod}) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{4099}, size_t{70001}}) {
        run_ranks(world, [&](Group& g) {
          std::mt19937 rng(static_cast<unsigned>(g.rank() * 1000 + static_cast<int>(count)));
          std::vector<float> input(count * static_cast<size_t>(world));
          fill(input, rng);
          std::vector<double> input64(input.begin(), input.end());
          std::vector<int32_t> input32(input.begin(), input.end());
          // Rank q's inputs at q * stride: f32 first, then f64, then i32; a stride with slack.
          const size_t f32_bytes = input.size() * 4, f64_bytes = input.size() * 8, i32_bytes = input.size() * 4;
          const size_t stride = f32_bytes + f64_bytes + i32_bytes + 64;
          SharedMemory m = allocate_shared(g, 16 + stride * static_cast<size_t>(world));
          char* mine = m.data() + 16 + static_cast<size_t>(g.rank()) * stride;
          std::memcpy(mine, input.data(), f32_bytes);
          std::memcpy(mine + f32_bytes, input64.data(), f64_bytes);
          std::memcpy(mine + f32_bytes + f64_bytes, input32.data(), i32_bytes);

          std::vector<float> want(count + 1), got(count + 1);
          std::vector<double> want64(count + 1), got64(count + 1);
          std::vector<int32_t> want32(count + 1), got32(count + 1);
          g.reduce_scatter(input.data(), want.data(), count, DataType::f32, op);
          g.reduce_scatter(input64.data(), want64.data(), count, DataType::f64, op);
          g.reduce_scatter(input32.data(), want32.data(), count, DataType::i32, op);
          Work a = reduce_scatter_shared_async(g, m, 16, stride, got.data(), count, DataType::f32, op);
          Work b = reduce_scatter_shared_async(g, m, 16 + f32_bytes, stride, got64.data(), count, DataType::f64, op);
          Work c = reduce_scatter_shared_async(g, m, 16 + f32_bytes + f64_bytes, stride, got32.data(), count,
                                               DataType::i32, op);
          a.wait();
          b.wait();
          c.wait();
          const std::string what = fmt::format("world {} {} count {} rank {}", world, name_of(op), count, g.rank());
          EXPECT_EQ(0, std::memcmp(want.data(), got.data(), count * 4)) << "f32 " << what;
          EXPECT_EQ(0, std::memcmp(want64.data(), got64.data(), count * 8)) << "f64 " << what;
          EXPECT_EQ(want32, got32) << "i32 " << what;
        });
      }
    }
  }
}

TEST(SharedMemory, AllReduceInPlaceEqualsTheCopyingOneBitwise) {
  // Every rank's vectors at offset + q * stride: f32, f64, then i32 (exact), each compared with
  // the copying all_reduce of the same inputs. Counts below, at and far above one block per
  // rank, and not multiples of the ranks or of a cache line.
  for (int world : {1, 2, 3, 5, 8}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::prod}) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{4099}, size_t{70001}}) {
        if (world == 8 && count > 4099 && op != ReduceOp::sum) continue;  // the largest only with sum at 8 ranks
        run_ranks(world, [&](Group& g) {
          std::mt19937 rng(static_cast<unsigned>(g.rank() * 7919 + static_cast<int>(count)));
          std::vector<float> input(count);
          fill(input, rng);
          std::vector<double> input64(input.begin(), input.end());
          std::vector<int32_t> input32(input.begin(), input.end());
          const size_t f32_bytes = count * 4, f64_bytes = count * 8, i32_bytes = count * 4;
          const size_t stride = f32_bytes + f64_bytes + i32_bytes + 40;  // not a multiple of a line
          SharedMemory m = allocate_shared(g, 24 + stride * static_cast<size_t>(world));
          char* mine = m.data() + 24 + static_cast<size_t>(g.rank()) * stride;
          std::memcpy(mine, input.data(), f32_bytes);
          std::memcpy(mine + f32_bytes, input64.data(), f64_bytes);
          std::memcpy(mine + f32_bytes + f64_bytes, input32.data(), i32_bytes);

          std::vector<float> want(count);
          std::vector<double> want64(count);
          std::vector<int32_t> want32(count);
          g.all_reduce(input.data(), want.data(), count, DataType::f32, op);
          g.all_reduce(input64.data(), want64.data(), count, DataType::f64, op);
          g.all_reduce(input32.data(), want32.data(), count, DataType::i32, op);
          Work a = all_reduce_shared_async(g, m, 24, stride, count, DataType::f32, op);
          Work b = all_reduce_shared_async(g, m, 24 + f32_bytes, stride, count, DataType::f64, op);
          all_reduce_shared(g, m, 24 + f32_bytes + f64_bytes, stride, count, DataType::i32, op);
          a.wait();
          b.wait();
          const std::string what = fmt::format("world {} {} count {} rank {}", world, name_of(op), count, g.rank());
          // This rank's vector and every other one hold the result.
          for (int q = 0; q < world; ++q) {
            const char* theirs = m.data() + 24 + static_cast<size_t>(q) * stride;
            EXPECT_EQ(0, std::memcmp(want.data(), theirs, f32_bytes)) << "f32 of rank " << q << ", " << what;
            EXPECT_EQ(0, std::memcmp(want64.data(), theirs + f32_bytes, f64_bytes))
                << "f64 of rank " << q << ", " << what;
            EXPECT_EQ(0, std::memcmp(want32.data(), theirs + f32_bytes + f64_bytes, i32_bytes))
                << "i32 of rank " << q << ", " << what;
          }
          // The bytes around the vectors are untouched.
          for (size_t i = 0; i < 24; ++i) ASSERT_EQ(m.data()[i], 0) << what;
          for (int q = 0; q < world; ++q) {
            const char* slack = m.data() + 24 + static_cast<size_t>(q) * stride + f32_bytes + f64_bytes + i32_bytes;
            for (size_t i = 0; i < 40; ++i) ASSERT_EQ(slack[i], 0) << "slack of rank " << q << ", " << what;
          }
          g.barrier();  // nobody frees the memory while another rank still checks it
        });
      }
    }
  }
}

TEST(SharedMemory, AllReducesInSharedMemoryRepeatAndInterleaveWithCopyingCalls) {
  // The same vectors reduced again and again (sum of ones grows by the world size each time),
  // with copying collectives and barriers in between, at sizes of several blocks per rank.
  for (int world : {2, 3, 4}) {
    run_ranks(world, [&](Group& g) {
      constexpr size_t kCount = 300007;
      const size_t stride = kCount * 4;
      SharedMemory m = allocate_shared(g, stride * static_cast<size_t>(world));
      auto* mine = reinterpret_cast<float*>(m.data() + static_cast<size_t>(g.rank()) * stride);
      for (size_t i = 0; i < kCount; ++i) mine[i] = static_cast<float>(i % 5);
      g.barrier();
      double factor = 1;
      for (int round = 0; round < 4; ++round) {
        all_reduce_shared(g, m, 0, stride, kCount, DataType::f32, ReduceOp::sum);
        factor *= world;
        for (size_t i = 0; i < kCount; ++i) {
          ASSERT_EQ(mine[i], static_cast<float>(static_cast<double>(i % 5) * factor))
              << "rank " << g.rank() << " round " << round << " element " << i;
        }
        std::vector<int64_t> x(1000, g.rank());
        g.all_reduce(x.data(), x.data(), x.size(), DataType::i64, ReduceOp::sum);
        ASSERT_EQ(x[999], static_cast<int64_t>(world * (world - 1) / 2));
        g.barrier();
      }
    });
  }
}

TEST(SharedMemory, MisuseIsNamed) {
  // Inputs that do not fit, or that overlap.
  run_ranks(2, [](Group& g) {
    SharedMemory m = allocate_shared(g, 1000);
    std::vector<float> out(100);
    try {
      (void)reduce_scatter_shared_async(g, m, 0, 400, out.data(), 100, DataType::f32, ReduceOp::sum);
      ADD_FAILURE() << "inputs of 800 bytes every 400 bytes were accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("do not fit"), std::string::npos) << e.what();
    }
    try {
      (void)reduce_scatter_shared_async(g, SharedMemory(), 0, 8, out.data(), 1, DataType::f32, ReduceOp::sum);
      ADD_FAILURE() << "an empty SharedMemory was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("allocate_shared"), std::string::npos) << e.what();
    }
  });
  // Over tcp there is nothing to share.
  GroupOptions tcp = quick_options();
  tcp.transport = TransportKind::tcp;
  tcp.secret = "40794539e77bf0427a0e28a929244e1e50b155ab2ea59b980615f8226dae97e5";
  run_ranks(
      2,
      [](Group& g) {
        EXPECT_FALSE(can_share_memory(g));
        try {
          (void)allocate_shared(g, 64);
          ADD_FAILURE() << "allocate_shared worked over tcp";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("not tcp"), std::string::npos) << e.what();
        }
      },
      tcp);
  // One rank reduces from shared memory, the other calls the copying reduce_scatter: both fail,
  // naming both calls.
  run_ranks(2, [](Group& g) {
    SharedMemory m = allocate_shared(g, 2 * 64);
    std::vector<float> in(8), out(4);
    try {
      if (g.rank() == 0) {
        reduce_scatter_shared_async(g, m, 0, 64, out.data(), 4, DataType::f32, ReduceOp::sum).wait();
      } else {
        g.reduce_scatter(in.data(), out.data(), 4, DataType::f32, ReduceOp::sum);
      }
      ADD_FAILURE() << "rank " << g.rank() << ": mismatched calls went through";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("reduce_scatter (shared memory)(f32, 4, sum)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("reduce_scatter(f32, 4, sum)"), std::string::npos) << msg;
    }
  });
}
TEST(SharedMemory, AllReduceMismatchesAndMisuseAreNamed) {
  run_ranks(2, [](Group& g) {
    SharedMemory m = allocate_shared(g, 2 * 64);
    try {
      (void)all_reduce_shared_async(g, m, 0, 32, 16, DataType::f32, ReduceOp::sum);
      ADD_FAILURE() << "vectors of 64 bytes every 32 bytes were accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("do not fit"), std::string::npos) << e.what();
    }
    try {  // an offset that wraps the end past zero, which a plain sum would let through
      (void)all_reduce_shared_async(g, m, SIZE_MAX - 2, 64, 1, DataType::f32, ReduceOp::sum);
      ADD_FAILURE() << "an offset near SIZE_MAX was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("do not fit"), std::string::npos) << e.what();
    }
    try {
      (void)all_reduce_shared_async(g, SharedMemory(), 0, 64, 1, DataType::f32, ReduceOp::sum);
      ADD_FAILURE() << "an empty SharedMemory was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("allocate_shared"), std::string::npos) << e.what();
    }
    // One rank reduces in shared memory, the other calls the copying all_reduce (of more than
    // the lines' 192 bytes, so both take staged phases): both fail, naming both calls.
    std::vector<float> in(16);
    try {
      if (g.rank() == 0) {
        all_reduce_shared(g, m, 0, 64, 16, DataType::f32, ReduceOp::sum);
      } else {
        std::vector<float> big(100);
        g.all_reduce(big.data(), big.data(), big.size(), DataType::f32, ReduceOp::sum);
      }
      ADD_FAILURE() << "rank " << g.rank() << ": mismatched calls went through";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("all_reduce (shared memory)(f32, 16, sum)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("all_reduce(f32, 100, sum)"), std::string::npos) << msg;
    }
  });
}

}  // namespace
}  // namespace dtrain::comm
