// Group: collectives through the real shared-memory transport, ranks as threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <string>
#include <thread>

#include "comm_test_util.h"
#include "dtrain/comm/group.h"

using namespace dtrain::comm;

namespace {

using dtrain::comm::test_util::run_ranks;

class GroupSizes : public ::testing::TestWithParam<int> {};

TEST_P(GroupSizes, AllReduceSumIsExactAndIdenticalOnEveryRank) {
  const int p = GetParam();
  for (size_t count : {size_t{0}, size_t{1}, size_t{13}, size_t{4099}, size_t{1} << 18}) {
    run_ranks(p, [&](Group& g) {
      std::vector<float> x(count);
      for (size_t i = 0; i < count; ++i) x[i] = static_cast<float>((g.rank() + 1) * 10 + static_cast<int>(i % 7));
      std::vector<float> out(count);
      g.all_reduce(x.data(), out.data(), count, DataType::f32, ReduceOp::sum);
      for (size_t i = 0; i < count; ++i) {
        const float expected = static_cast<float>(10 * p * (p + 1) / 2 + p * static_cast<int>(i % 7));
        ASSERT_EQ(out[i], expected) << "rank " << g.rank() << " element " << i << " count " << count;
      }
      g.all_reduce(x.data(), x.data(), count, DataType::f32, ReduceOp::avg);  // in place
      for (size_t i = 0; i < count; ++i) {
        ASSERT_FLOAT_EQ(x[i], out[i] / static_cast<float>(p)) << "avg, element " << i;
      }
    });
  }
}

TEST_P(GroupSizes, BroadcastGatherScatterAllToAllBarrier) {
  const int p = GetParam();
  run_ranks(p, [&](Group& g) {
    const int r = g.rank();
    for (int root = 0; root < p; ++root) {
      std::vector<int32_t> b(37, r == root ? root * 100 : -1);
      g.broadcast(b.data(), b.size(), DataType::i32, root);
      for (int32_t v : b) ASSERT_EQ(v, root * 100);
    }
    std::vector<int64_t> mine(3, r), all(static_cast<size_t>(3 * p), -1);
    g.all_gather(mine.data(), all.data(), 3, DataType::i64);
    for (int q = 0; q < p; ++q) ASSERT_EQ(all[static_cast<size_t>(3 * q + 2)], q);
    std::vector<double> src(static_cast<size_t>(2 * p)), dst(2);
    for (int q = 0; q < p; ++q) src[static_cast<size_t>(2 * q)] = src[static_cast<size_t>(2 * q + 1)] = q + r;
    g.reduce_scatter(src.data(), dst.data(), 2, DataType::f64, ReduceOp::sum);
    ASSERT_EQ(dst[0], static_cast<double>(r * p + p * (p - 1) / 2));
    std::vector<uint8_t> a2a_in(static_cast<size_t>(p)), a2a_out(static_cast<size_t>(p));
    for (int q = 0; q < p; ++q) a2a_in[static_cast<size_t>(q)] = static_cast<uint8_t>(r * 16 + q);
    g.all_to_all(a2a_in.data(), a2a_out.data(), 1, DataType::u8);
    for (int q = 0; q < p; ++q) ASSERT_EQ(a2a_out[static_cast<size_t>(q)], q * 16 + r);
    g.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, GroupSizes, ::testing::Values(1, 2, 3, 4, 5, 8));

TEST(Group, SplitFormsSubGroupsOrderedByKey) {
  run_ranks(6, [](Group& g) {
    Group sub = g.split(g.rank() % 2, -g.rank());  // reverse order inside each color
    ASSERT_EQ(sub.size(), 3);
    EXPECT_EQ(sub.rank(), 2 - g.rank() / 2);
    int32_t v = g.rank();
    int32_t sum = 0;
    sub.all_reduce(&v, &sum, 1, DataType::i32, ReduceOp::sum);
    EXPECT_EQ(sum, g.rank() % 2 == 0 ? 0 + 2 + 4 : 1 + 3 + 5);
    Group none = g.split(g.rank() == 0 ? -1 : 0, 0);
    EXPECT_EQ(none.size(), g.rank() == 0 ? 0 : 5);
  });
}

TEST(Group, SendRecvInOrderAndAsyncCollectivesCompleteInIssueOrder) {
  run_ranks(2, [](Group& g) {
    std::vector<float> a(1000, static_cast<float>(g.rank())), b(1000), c(1 << 16, 1.0f), d(1 << 16);
    Work w1 = g.all_reduce_async(a.data(), b.data(), a.size(), DataType::f32, ReduceOp::sum);
    Work w2 = g.all_reduce_async(c.data(), d.data(), c.size(), DataType::f32, ReduceOp::max);
    w2.wait();
    EXPECT_TRUE(w1.test());  // issued first, so finished first
    EXPECT_EQ(b[0], 1.0f);
    EXPECT_EQ(d[5], 1.0f);
    if (g.rank() == 0) {
      int64_t x = 41, y = 42;
      g.send(&x, 1, DataType::i64, 1, 7);
      g.send(&y, 1, DataType::i64, 1, 8);
    } else {
      int64_t x = 0, y = 0;
      g.recv(&x, 1, DataType::i64, 0, 7);
      g.recv(&y, 1, DataType::i64, 0, 8);
      EXPECT_EQ(x, 41);
      EXPECT_EQ(y, 42);
    }
  });
}

TEST(Group, TimeoutNamesTheRankThatDidNotArriveAndBreaksTheGroup) {
  GroupOptions opts;
  opts.timeout = std::chrono::milliseconds(500);
  std::atomic<bool> rank0_raised{false};
  run_ranks(
      3,
      [&](Group& g) {
        if (g.rank() == 2) return;  // never joins the all_reduce
        float x = 1, y = 0;
        const auto t0 = std::chrono::steady_clock::now();
        try {
          g.all_reduce(&x, &y, 1, DataType::f32, ReduceOp::sum);
          ADD_FAILURE() << "all_reduce returned without rank 2";
        } catch (const CommError& e) {
          const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          EXPECT_LT(s, 3.0) << e.what();
          EXPECT_EQ(e.op(), "all_reduce");
          EXPECT_EQ(e.seq(), 0u);
          if (g.rank() == 0) rank0_raised = true;
        }
        EXPECT_THROW(g.barrier(), CommError);  // broken group fails at once
      },
      opts);
  EXPECT_TRUE(rank0_raised);
}

// GroupOptions::spin keeps a wait spinning instead of sleeping: messages still arrive, and the
// deadline still ends a wait that spins longer than the timeout.
TEST(Group, ASpinningWaitDeliversAndStillEndsAtItsDeadline) {
  GroupOptions opts;
  opts.timeout = std::chrono::milliseconds(300);
  opts.spin = std::chrono::seconds(3);
  run_ranks(
      2,
      [&](Group& g) {
        std::vector<float> v(1000, static_cast<float>(g.rank()));
        if (g.rank() == 1) {
          g.send(v.data(), v.size(), DataType::f32, 0, 1);
        } else {
          g.recv(v.data(), v.size(), DataType::f32, 1, 1);
          EXPECT_EQ(v.front(), 1.0f);
          EXPECT_EQ(v.back(), 1.0f);
        }
        // Both wait for a message the other never sends: each wait times out, spinning.
        const auto t0 = std::chrono::steady_clock::now();
        EXPECT_THROW(g.recv(v.data(), v.size(), DataType::f32, 1 - g.rank(), 2), CommError);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        EXPECT_GT(s, 0.2) << "the wait ended before its timeout";
        EXPECT_LT(s, 2.0) << "the 3 s spin outlasted the 300 ms timeout";
      },
      opts);
}

}  // namespace

// An asynchronous send larger than the transport's ring followed by a blocking receive, all
// ranks at once around a ring: the receive must not queue behind the send (that deadlocks).
TEST(Group, AsyncSendThenBlockingRecvAroundARingDoesNotDeadlock) {
  const size_t n = size_t{3} << 20;  // 12 MiB of f32, far more than a 1 MiB ring
  for (int p : {2, 3, 5}) {
    run_ranks(p, [&](Group& g) {
      const int r = g.rank();
      std::vector<float> out(n), in(n, -1.0f);
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(r * 1000 + static_cast<int>(i % 997));
      Work w = g.send_async(out.data(), n, DataType::f32, (r + 1) % p, 3);
      Work w2 = g.send_async(out.data(), 5, DataType::f32, (r + 1) % p, 4);
      g.recv(in.data(), n, DataType::f32, (r + p - 1) % p, 3);
      std::vector<float> small(5);
      Work rw = g.recv_async(small.data(), 5, DataType::f32, (r + p - 1) % p, 4);
      w.wait(std::chrono::seconds(60));
      w2.wait(std::chrono::seconds(60));
      rw.wait(std::chrono::seconds(60));
      const int from = (r + p - 1) % p;
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(in[i], static_cast<float>(from * 1000 + static_cast<int>(i % 997))) << i;
      for (size_t i = 0; i < 5; ++i) ASSERT_EQ(small[i], static_cast<float>(from * 1000 + static_cast<int>(i)));
      g.barrier();
    });
  }
}

// Vectors past the direct path's streaming-store threshold for more ranks than cores (1 MiB;
// p = 3 on this 2-core machine), odd length.
TEST(Group, LargeAllReduceThroughStreamingCopiesIsExact) {
  const size_t n = (size_t{20} << 20) / sizeof(float) + 3;
  for (int p : {2, 3}) {
    run_ranks(p, [&](Group& g) {
      std::vector<float> x(n);
      for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>((g.rank() + 1) * static_cast<int>(i % 9));
      std::vector<float> out(n, -1.0f);
      g.all_reduce(x.data(), out.data(), n, DataType::f32, ReduceOp::sum);
      const int tri = p * (p + 1) / 2;
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], static_cast<float>(tri * static_cast<int>(i % 9))) << i;
    });
  }
}

// The direct all_reduce writes large chunks into its staging slot with plain or streaming
// stores (DTRAIN_SHM_STREAM_STAGE=0|1, or chosen per call by timing: auto). Only the speed may
// differ: every mode gives the same bits, in place and out of place, from buffers that start
// at different offsets (copy.h's own loop takes the ones near a page alias), one chunk or
// several, 2 and 3 ranks.
TEST(Group, EveryStagingWriteModeGivesTheSameBits) {
  const size_t n = (size_t{3} << 20) / sizeof(float) + 5;  // three staging chunks and a bit
  std::vector<std::vector<std::vector<float>>> results;    // [mode][case], rank 0's output
  for (const char* mode : {"0", "1", "auto"}) {
    ::setenv("DTRAIN_SHM_STREAM_STAGE", mode, 1);
    for (int p : {2, 3}) {
      std::vector<std::vector<float>> got;
      run_ranks(
          p,
          [&](Group& g) {
            for (const size_t len : {size_t{5000}, n}) {
              for (const size_t shift : {size_t{0}, size_t{1}, size_t{4}}) {
                for (const bool in_place : {false, true}) {
                  std::vector<float> x(len + shift), out(len + shift, -1.0f);
                  for (size_t i = 0; i < len; ++i)
                    x[i + shift] = 1.0f / static_cast<float>(1 + (i * 7 + g.rank() * 13) % 101);
                  float* dst = in_place ? x.data() + shift : out.data() + shift;
                  g.all_reduce(x.data() + shift, dst, len, DataType::f32, ReduceOp::sum);
                  if (g.rank() == 0) got.emplace_back(dst, dst + len);
                }
              }
            }
          },
          test_util::quick_options());
      results.push_back(std::move(got));
    }
  }
  ::unsetenv("DTRAIN_SHM_STREAM_STAGE");
  ASSERT_EQ(results.size(), 6u);
  for (size_t m = 2; m < results.size(); ++m) {
    ASSERT_EQ(results[m].size(), results[m % 2].size());
    for (size_t c = 0; c < results[m].size(); ++c) {
      ASSERT_EQ(0, std::memcmp(results[m][c].data(), results[m % 2][c].data(), results[m][c].size() * sizeof(float)))
          << "mode #" << m / 2 << ", " << (m % 2 ? 3 : 2) << " ranks, case " << c;
    }
  }
  // And the sums are right: 1/k summed in rank order is not exact, so compare with the
  // single-process sum in the same order.
  for (size_t c = 0; c < results[0].size(); ++c) {
    const size_t len = results[0][c].size();
    for (size_t i = 0; i < len; i += 97) {
      const float want =
          1.0f / static_cast<float>(1 + (i * 7) % 101) + 1.0f / static_cast<float>(1 + (i * 7 + 13) % 101);
      ASSERT_EQ(results[0][c][i], want) << "case " << c << " element " << i;
    }
  }
}

// all_reduces of up to 192 bytes travel in cache lines that carry their own flag (48 bytes of
// data each; shm_collectives.cpp). Every count across that limit, in and out of place, on 2, 3
// and 5 ranks, twice in a row (both parities of the lines): each rank gets the single-process
// sum in rank order, bit for bit, and max.
TEST(Group, SmallAllReducesInLinesEqualTheOneProcessSum) {
  for (int p : {2, 3, 5}) {
    std::atomic<int> bad{0};
    run_ranks(
        p,
        [&](Group& g) {
          auto value = [](size_t i, int r) {
            return 1.0f / static_cast<float>(1 + (i * 7 + static_cast<size_t>(r) * 13) % 101);
          };
          for (size_t len = 1; len <= 52; ++len) {
            for (const bool in_place : {false, true}) {
              for (int round = 0; round < 2; ++round) {
                for (const ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
                  std::vector<float> x(len), out(len, -1.0f);
                  for (size_t i = 0; i < len; ++i) x[i] = value(i + round, g.rank());
                  float* dst = in_place ? x.data() : out.data();
                  g.all_reduce(x.data(), dst, len, DataType::f32, op);
                  for (size_t i = 0; i < len; ++i) {
                    float want = value(i + round, 0);
                    for (int r = 1; r < p; ++r)
                      want = op == ReduceOp::sum ? want + value(i + round, r) : std::max(want, value(i + round, r));
                    if (std::memcmp(&dst[i], &want, sizeof(float)) != 0) {
                      if (bad++ < 5)
                        ADD_FAILURE() << p << " ranks, rank " << g.rank() << ", " << len << " floats, element " << i;
                    }
                  }
                }
              }
            }
          }
        },
        test_util::quick_options());
    EXPECT_EQ(bad.load(), 0) << p << " ranks";
  }
}

// Calls in lines, staged calls and barriers in one sequence, three times over (the lines'
// parity follows only the calls in lines, the call records' parity every call): u8 and f64 with
// partial and full last lines, on 3 and 8 ranks; integer values, so every result is exact.
TEST(Group, CallsInLinesInterleaveWithStagedCalls) {
  for (int p : {3, 8}) {
    std::atomic<int> bad{0};
    run_ranks(
        p,
        [&](Group& g) {
          const int r = g.rank();
          auto value = [](size_t i, int q) { return static_cast<int>((i + 3 * static_cast<size_t>(q)) % 5); };
          auto expect = [&](size_t i, ReduceOp op) {
            int want = value(i, 0);
            for (int q = 1; q < p; ++q) want = op == ReduceOp::sum ? want + value(i, q) : std::max(want, value(i, q));
            return want;
          };
          for (int round = 0; round < 3; ++round) {
            for (const size_t n : {size_t{49}, size_t{192}}) {  // u8: 2 lines, the second partial; 4 full lines
              std::vector<uint8_t> x(n);
              for (size_t i = 0; i < n; ++i) x[i] = static_cast<uint8_t>(value(i, r));
              g.all_reduce(x.data(), x.data(), n, DataType::u8, ReduceOp::sum);
              for (size_t i = 0; i < n; ++i) bad += x[i] != expect(i, ReduceOp::sum);
            }
            g.barrier();
            for (const size_t n : {size_t{7}, size_t{24}}) {  // f64: 56 and 192 bytes
              std::vector<double> x(n), out(n);
              for (size_t i = 0; i < n; ++i) x[i] = value(i, r);
              g.all_reduce(x.data(), out.data(), n, DataType::f64, ReduceOp::max);
              for (size_t i = 0; i < n; ++i) bad += out[i] != expect(i, ReduceOp::max);
            }
            std::vector<float> big(100);  // 400 bytes: the staged path
            for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(value(i, r));
            g.all_reduce(big.data(), big.data(), big.size(), DataType::f32, ReduceOp::sum);
            for (size_t i = 0; i < big.size(); ++i) bad += big[i] != static_cast<float>(expect(i, ReduceOp::sum));
            int64_t one = r + 1;
            g.all_reduce(&one, &one, 1, DataType::i64, ReduceOp::sum);
            bad += one != static_cast<int64_t>(p) * (p + 1) / 2;
          }
        },
        test_util::quick_options());
    EXPECT_EQ(bad.load(), 0) << p << " ranks";
  }
}

// A mistyped mode is refused when the group is made, naming the variable.
TEST(Group, AMistypedStagingWriteModeIsNamed) {
  ::setenv("DTRAIN_SHM_STREAM_STAGE", "yes", 1);
  GroupOptions o = test_util::quick_options();
  o.timeout = std::chrono::seconds(10);
  try {
    run_ranks(
        2, [](Group&) {}, o);
    ::unsetenv("DTRAIN_SHM_STREAM_STAGE");
    FAIL() << "DTRAIN_SHM_STREAM_STAGE=yes was accepted";
  } catch (const std::exception& e) {
    ::unsetenv("DTRAIN_SHM_STREAM_STAGE");
    EXPECT_NE(std::string(e.what()).find("DTRAIN_SHM_STREAM_STAGE='yes'"), std::string::npos) << e.what();
  }
}

// Voluntary context switches of this process's group progress threads, summed.
long progress_thread_switches() {
  long total = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::string comm;
    std::getline(std::ifstream(task.path() / "comm"), comm);
    if (comm != "dtrain-progress") continue;
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("voluntary_ctxt_switches:", 0) == 0) total += std::stol(line.substr(24));
    }
  }
  return total;
}

// A blocking collective runs in the caller's thread; the progress thread must not be woken
// for it (each needless wake-up cost a 4-rank all_reduce on 2 cores about 30 us).
TEST(Group, BlockingCollectivesLeaveTheProgressThreadAsleep) {
  constexpr int kCalls = 2000;
  std::atomic<long> before{-1}, after{-1};
  run_ranks(2, [&](Group& g) {
    g.barrier();
    if (g.rank() == 0) before = progress_thread_switches();
    g.barrier();
    float x = 1.0f;
    for (int k = 0; k < kCalls; ++k) {
      g.all_reduce(&x, &x, 1, DataType::f32, ReduceOp::max);
      g.barrier();
    }
    if (g.rank() == 0) after = progress_thread_switches();
    g.barrier();
  });
  ASSERT_GE(before.load(), 0);
  // 0-2 here; with a wake-up after every blocking call, 318 (a wake-up only reaches a thread
  // that is asleep already).
  EXPECT_LT(after - before, 50) << "progress threads switched " << after - before << " times";
}
