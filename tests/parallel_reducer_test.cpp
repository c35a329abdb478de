// The gradient reducer over plain float buffers, with no dtrain::Tensor anywhere (the way a
// second tensor type, e.g. libtorch's, drives it): ranks as threads over the shm transport,
// gradients marked ready in a different order on every rank, buckets cut at the size cap, and
// every strategy's result checked against a plain all_reduce average of the same buffers: bit
// for bit for the exact ones (all_reduce, shared memory, ZeRO 1/2 and their shared variant),
// within the codec's bound for int8, exactly for bf16 on values it represents, PowerSGD on a
// gradient of rank one. A buffer that never becomes ready counts as zeros, a rank that marks
// nothing gets a clear error on every rank, and a rank that never finishes a timeout, not a hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "comm_test_util.h"
#include "dtrain/comm/group.h"
#include "dtrain/parallel/reducer.h"

namespace dtrain::parallel {
namespace {

using comm::DataType;
using comm::ReduceOp;

// Parameter sizes: 0, 1, primes, one of 5003 floats (20 KiB: a bucket over the 16 KiB below
// which the shared all_reduce copies instead).
const std::vector<size_t> kSizes = {7, 1, 131, 64, 0, 3, 5003, 5, 29};
constexpr size_t kBucketBytes = 160 * sizeof(float);  // several buckets, some of several parameters

void run_ranks(int size, const std::function<void(comm::Group&)>& fn,
               comm::Duration timeout = std::chrono::seconds(30)) {
  comm::GroupOptions o = comm::test_util::quick_options();
  o.timeout = timeout;
  comm::test_util::run_ranks(size, fn, o);
}

// Small integers: every sum over ranks is exact, so the plain average is the oracle.
float gradient_value(int rank, size_t param, size_t i, int step) {
  return static_cast<float>(static_cast<int>((static_cast<size_t>(rank + 1) * 7 + param * 3 + i) % 17) - 8 + step);
}

// This rank's buffers: values (the same on every rank, as after a broadcast) and gradients.
struct Buffers {
  std::vector<std::vector<float>> values, grads;
  Buffers(int rank, int step) {
    for (size_t k = 0; k < kSizes.size(); ++k) {
      values.emplace_back(kSizes[k]);
      grads.emplace_back(kSizes[k]);
      for (size_t i = 0; i < kSizes[k]; ++i) {
        values[k][i] = 0.25f * static_cast<float>(k + i % 5);
        grads[k][i] = gradient_value(rank, k, i, step);
      }
    }
  }
  std::vector<ReducerParam> params() {
    std::vector<ReducerParam> out;
    for (size_t k = 0; k < values.size(); ++k) {
      out.push_back({"p" + std::to_string(k), {values[k].data(), values[k].size(), DataType::f32, nullptr}});
    }
    return out;
  }
};

// The oracle: each gradient all_reduced (avg) on its own.
std::vector<std::vector<float>> plain_average(comm::Group& g, const std::vector<std::vector<float>>& grads) {
  std::vector<std::vector<float>> out;
  for (const auto& v : grads) {
    out.emplace_back(v.size());
    if (!v.empty()) g.all_reduce(v.data(), out.back().data(), v.size(), DataType::f32, ReduceOp::avg);
  }
  return out;
}

// A different order of readiness on every rank: rank 0 forward (the reverse of the buckets'
// order), rank 1 backward, the others a rotation.
std::vector<size_t> ready_order(int rank) {
  std::vector<size_t> order(kSizes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  if (rank == 1) std::reverse(order.begin(), order.end());
  if (rank >= 2) std::rotate(order.begin(), order.begin() + rank % static_cast<int>(order.size()), order.end());
  return order;
}

// Parameter k's averaged gradient as this rank holds it: the whole slot, or under ZeRO the part
// in this rank's piece (elements [lo, hi) of k), checked against `want`.
void expect_reduced(const Reducer& reducer, size_t k, const std::vector<float>& want, const std::string& what) {
  if (!reducer.sharded()) {
    const BufferView v = reducer.grad(k);
    ASSERT_EQ(v.count, want.size());
    const float* got = static_cast<const float*>(v.data);
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(got[i], want[i]) << what << ", parameter " << k << "[" << i << "]";
    return;
  }
  const size_t b = reducer.bucket_of(k);
  const auto& params = reducer.bucket_params(b);
  const size_t offset =
      reducer.bucket_offsets(b)[static_cast<size_t>(std::find(params.begin(), params.end(), k) - params.begin())];
  const size_t piece = reducer.piece_count(b);
  const size_t lo = static_cast<size_t>(reducer.group().rank()) * piece, hi = lo + piece;
  const float* got = static_cast<const float*>(reducer.piece_grad(b).data);
  for (size_t e = std::max(lo, offset); e < std::min(hi, offset + want.size()); ++e) {
    ASSERT_EQ(got[e - lo], want[e - offset]) << what << ", parameter " << k << "[" << e - offset << "]";
  }
}

struct Strategy {
  std::string name;
  int zero;
  bool share_memory;
  bool shared;  // expected to share memory
};

const std::vector<Strategy> kExact = {{"all_reduce", 0, false, false},
                                      {"shared all_reduce", 0, true, true},
                                      {"zero 1", 1, false, false},
                                      {"shared zero 1", 1, true, true},
                                      {"zero 2", 2, true, false}};

TEST(Reducer, LaysOutBucketsInReverseOrderUpToTheCap) {
  run_ranks(2, [](comm::Group& g) {
    Buffers buf(g.rank(), 0);
    ReducerOptions o;
    o.bucket_bytes = kBucketBytes;
    o.share_memory = false;
    o.zero = 1;
    Reducer reducer(buf.params(), g, o);
    std::vector<size_t> seen;
    for (size_t b = 0; b < reducer.num_buckets(); ++b) {
      const auto& params = reducer.bucket_params(b);
      const auto& offsets = reducer.bucket_offsets(b);
      size_t at = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_EQ(offsets[i], at) << "bucket " << b;
        EXPECT_EQ(reducer.bucket_of(params[i]), b);
        at += kSizes[params[i]];
        seen.push_back(params[i]);
      }
      EXPECT_EQ(reducer.bucket_count(b), at);
      // Over the cap only when one parameter alone is.
      if (params.size() > 1) {
        EXPECT_LE(at * sizeof(float), kBucketBytes) << "bucket " << b;
      }
      EXPECT_EQ(reducer.bucket_padded(b) % 2, 0u);
      EXPECT_GE(reducer.bucket_padded(b), at);
      EXPECT_EQ(reducer.piece_count(b) * 2, reducer.bucket_padded(b));
      // ZeRO: the parameters' values were copied into the bucket.
      for (size_t i = 0; i < params.size(); ++i) {
        const BufferView v = reducer.values(params[i]);
        ASSERT_EQ(v.count, kSizes[params[i]]);
        if (v.count > 0) {
          EXPECT_EQ(std::memcmp(v.data, buf.values[params[i]].data(), v.bytes()), 0);
        }
      }
    }
    std::vector<size_t> reverse(kSizes.size());
    std::iota(reverse.rbegin(), reverse.rend(), size_t{0});
    EXPECT_EQ(seen, reverse);
    EXPECT_GE(reducer.num_buckets(), 4u);
  });
}

TEST(Reducer, EveryExactStrategyEqualsThePlainAverageWithReadinessInAnyOrder) {
  for (int world : {2, 3, 4}) {
    for (const Strategy& s : kExact) {
      const std::string what = s.name + ", world " + std::to_string(world);
      run_ranks(world, [&](comm::Group& g) {
        const int r = g.rank();
        Buffers initial(r, 0);
        ReducerOptions o;
        o.bucket_bytes = kBucketBytes;
        o.zero = s.zero;
        o.share_memory = s.share_memory;
        o.record_events = true;
        Reducer reducer(initial.params(), g, o);
        ASSERT_EQ(reducer.shares_memory(), s.shared) << what;
        ASSERT_EQ(reducer.shares_values(), s.shared && s.zero == 1) << what;
        std::vector<std::vector<float>> values = initial.values;  // ZeRO: as every rank must hold them
        for (int step = 0; step < 3; ++step) {
          Buffers buf(r, step);
          const auto want = plain_average(g, buf.grads);
          for (size_t k : ready_order(r)) {
            if (k % 3 == 1 && reducer.grad(k).data != nullptr) {
              // Written into the slot (as a gradient home), as the tensor layer's linear layers do.
              std::memcpy(reducer.grad(k).data, buf.grads[k].data(), buf.grads[k].size() * sizeof(float));
              reducer.mark_ready(k, reducer.grad(k).data);
            } else {
              reducer.mark_ready(k, buf.grads[k].data());  // copied in
            }
          }
          reducer.finish();
          for (size_t k = 0; k < kSizes.size(); ++k)
            expect_reduced(reducer, k, want[k], what + ", step " + std::to_string(step));
          // Buckets start in bucket order on every rank, whatever the order of readiness.
          const std::vector<BucketEvent> events = reducer.take_events();
          ASSERT_EQ(events.size(), reducer.num_buckets()) << what;
          for (size_t b = 1; b < events.size(); ++b) {
            EXPECT_EQ(events[b].bucket, static_cast<int>(b));
            EXPECT_LE(events[b - 1].start, events[b].start) << what << ": bucket " << b << " started first";
          }
          const CommVolume v = reducer.take_volume();
          EXPECT_GT(v.wire_bytes, 0u) << what;
          EXPECT_EQ(v.wire_bytes, v.raw_bytes) << what;
          if (!reducer.sharded()) continue;
          // ZeRO: an SGD step of rate 1 on this rank's pieces, then gather(): every rank holds
          // every updated value.
          for (size_t b = 0; b < reducer.num_buckets(); ++b) {
            float* piece = static_cast<float*>(reducer.piece(b).data);
            const float* grad = static_cast<const float*>(reducer.piece_grad(b).data);
            for (size_t i = 0; i < reducer.piece_count(b); ++i) piece[i] -= grad[i];
          }
          reducer.gather();
          for (size_t k = 0; k < kSizes.size(); ++k) {
            const float* got = static_cast<const float*>(reducer.values(k).data);
            for (size_t i = 0; i < kSizes[k]; ++i) {
              values[k][i] -= want[k][i];
              ASSERT_EQ(got[i], values[k][i]) << what << ", step " << step << ", value " << k << "[" << i << "]";
            }
          }
        }
      });
    }
  }
}

TEST(Reducer, ABufferThatNeverBecomesReadyCountsAsZeros) {
  // In the second step rank 1 never marks parameter 3 (in a bucket with others) nor 6 (alone in
  // its bucket, which so starts only in finish()): their gradients there are zeros in the
  // average, not what the slots held from the first step.
  for (const Strategy& s : {kExact[0], kExact[1], kExact[2], kExact[4]}) {
    run_ranks(3, [&](comm::Group& g) {
      const int r = g.rank();
      Buffers first(r, 0);
      ReducerOptions o;
      o.bucket_bytes = kBucketBytes;
      o.zero = s.zero;
      o.share_memory = s.share_memory;
      Reducer reducer(first.params(), g, o);
      ASSERT_EQ(reducer.bucket_params(reducer.bucket_of(6)).size(), 1u);
      ASSERT_GT(reducer.bucket_params(reducer.bucket_of(3)).size(), 1u);
      for (size_t k : ready_order(r)) reducer.mark_ready(k, first.grads[k].data());
      reducer.finish();
      Buffers buf(r, 1);
      auto skipped = [&](size_t k) { return r == 1 && (k == 3 || k == 6); };
      std::vector<std::vector<float>> sent = buf.grads;
      for (size_t k : {size_t{3}, size_t{6}}) {
        if (r == 1) std::fill(sent[k].begin(), sent[k].end(), 0.0f);
      }
      const auto want = plain_average(g, sent);
      for (size_t k : ready_order(r)) {
        if (!skipped(k)) reducer.mark_ready(k, buf.grads[k].data());
      }
      reducer.finish();
      for (size_t k = 0; k < kSizes.size(); ++k) expect_reduced(reducer, k, want[k], s.name);
    });
  }
}

TEST(Reducer, ARankThatMarksNothingGetsAClearErrorOnEveryRankNotAHang) {
  std::mutex mu;
  std::vector<std::string> messages;
  const auto start = comm::Clock::now();
  try {
    run_ranks(2, [&](comm::Group& g) {
      Buffers buf(g.rank(), 0);
      ReducerOptions o;
      o.bucket_bytes = kBucketBytes;
      Reducer reducer(buf.params(), g, o);
      if (g.rank() == 0) {
        for (size_t k : ready_order(0)) reducer.mark_ready(k, buf.grads[k].data());
      }
      try {
        reducer.finish();
      } catch (const Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        messages.push_back(e.what());
        throw;
      }
    });
  } catch (const Error&) {
  }
  EXPECT_LT(comm::test_util::since(start), std::chrono::seconds(10));
  ASSERT_EQ(messages.size(), 2u);
  for (const auto& m : messages) {
    EXPECT_NE(m.find("ranks ran different numbers of backward passes"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0: backward, rank 1: none"), std::string::npos) << m;
  }
}

TEST(Reducer, ARankThatNeverFinishesTimesTheOthersOut) {
  // Rank 1 marks everything (every bucket's collective completes) but never calls finish():
  // rank 0's finish() fails within the group's timeout instead of waiting forever.
  std::mutex mu;
  std::vector<std::string> messages;
  const auto start = comm::Clock::now();
  try {
    run_ranks(
        2,
        [&](comm::Group& g) {
          Buffers buf(g.rank(), 0);
          ReducerOptions o;
          o.bucket_bytes = kBucketBytes;
          o.share_memory = false;
          Reducer reducer(buf.params(), g, o);
          for (size_t k : ready_order(g.rank())) reducer.mark_ready(k, buf.grads[k].data());
          if (g.rank() == 1) return;
          try {
            reducer.finish();
          } catch (const comm::CommError& e) {
            std::lock_guard<std::mutex> lock(mu);
            messages.push_back(e.what());
            throw;
          }
        },
        std::chrono::milliseconds(1500));
  } catch (const Error&) {
  }
  EXPECT_LT(comm::test_util::since(start), std::chrono::seconds(20));
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_NE(messages[0].find("all_gather"), std::string::npos) << messages[0];
}

TEST(Reducer, ASecondGradientInOneStepIsAClearError) {
  run_ranks(1, [](comm::Group& g) {
    Buffers buf(0, 0);
    Reducer reducer(buf.params(), g, ReducerOptions{});
    reducer.mark_ready(2, buf.grads[2].data());
    try {
      reducer.mark_ready(2, buf.grads[2].data());
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("parameter 'p2' received a second gradient in step 1"), std::string::npos)
          << e.what();
    }
    try {
      reducer.mark_ready(3, nullptr);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("parameter 'p3': gradient hook fired without"), std::string::npos)
          << e.what();
    }
  });
}

TEST(Reducer, Bf16CompressionOfValuesItRepresentsEqualsThePlainAverage) {
  // Quarters of small integers need at most 8 significant bits: bf16 carries them exactly, so
  // the compressed all_reduce (ZeRO: reduce_scatter) gives the plain average's bits, leaves
  // zero residuals, and sends half the bytes.
  for (int world : {2, 4}) {
    for (int zero : {0, 1, 2}) {
      const std::string what = "zero " + std::to_string(zero) + ", world " + std::to_string(world);
      run_ranks(world, [&](comm::Group& g) {
        Buffers buf(g.rank(), 1);
        ReducerOptions o;
        o.bucket_bytes = kBucketBytes;
        o.zero = zero;
        o.compression = parse_compression("bf16");
        Reducer reducer(buf.params(), g, o);
        EXPECT_FALSE(reducer.shares_memory());
        const auto want = plain_average(g, buf.grads);
        for (size_t k : ready_order(g.rank())) reducer.mark_ready(k, buf.grads[k].data());
        reducer.finish();
        for (size_t k = 0; k < kSizes.size(); ++k) expect_reduced(reducer, k, want[k], what);
        const std::vector<StateEntry> state = reducer.state();
        ASSERT_EQ(state.size(), reducer.num_buckets()) << what;
        for (size_t b = 0; b < state.size(); ++b) {
          EXPECT_EQ(state[b].name, "ef." + std::to_string(b));
          EXPECT_EQ(state[b].shape, std::vector<int64_t>{static_cast<int64_t>(reducer.bucket_padded(b))});
          for (float v : state[b].values) ASSERT_EQ(v, 0.0f) << what << ": a residual in bucket " << b;
        }
        const CommVolume v = reducer.take_volume();
        ASSERT_GT(v.wire_bytes, 0u);
        EXPECT_NEAR(static_cast<double>(v.raw_bytes) / static_cast<double>(v.wire_bytes), 2.0, 0.2) << what;
        // The state goes back in, and a missing entry is named.
        reducer.load_state(state);
        try {
          reducer.load_state({});
          ADD_FAILURE() << "no error";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("compression state has no 'ef.0' of shape ["), std::string::npos)
              << e.what();
        }
      });
    }
  }
}

TEST(Reducer, Int8CompressionStaysWithinItsStepAndKeepsRanksIdentical) {
  run_ranks(3, [](comm::Group& g) {
    Buffers buf(g.rank(), 2);
    ReducerOptions o;
    o.bucket_bytes = kBucketBytes;
    o.compression = parse_compression("int8");
    Reducer reducer(buf.params(), g, o);
    const auto want = plain_average(g, buf.grads);
    for (size_t k : ready_order(g.rank())) reducer.mark_ready(k, buf.grads[k].data());
    reducer.finish();
    bool lossy = false;
    for (size_t k = 0; k < kSizes.size(); ++k) {
      const float* got = static_cast<const float*>(reducer.grad(k).data);
      std::vector<float> first(got, got + kSizes[k]);
      if (!first.empty()) g.broadcast(first.data(), first.size(), DataType::f32, 0);
      for (size_t i = 0; i < kSizes[k]; ++i) {
        ASSERT_EQ(got[i], first[i]) << "rank " << g.rank() << " differs from rank 0 at " << k << "[" << i << "]";
        // Inputs up to 10: half a step (10 / 127) per encoding, of each input and of the result.
        ASSERT_NEAR(got[i], want[k][i], 2 * 10.0 / 127) << k << "[" << i << "]";
        lossy = lossy || got[i] != want[k][i];
      }
    }
    EXPECT_TRUE(lossy) << "int8 changed nothing?";
    const CommVolume v = reducer.take_volume();
    EXPECT_GE(static_cast<double>(v.raw_bytes) / static_cast<double>(v.wire_bytes), 3.0);
  });
}

TEST(Reducer, PowerSgdCarriesARankOneGradientAndAveragesTheRest) {
  // A (12, 10) matrix whose gradient is c_r u v^T on rank r (the average is rank one, so one
  // factor pair carries it) and a vector, averaged as it is.
  constexpr int64_t kRows = 12, kCols = 10;
  run_ranks(2, [&](comm::Group& g) {
    const int r = g.rank();
    std::vector<float> w(kRows * kCols, 0.0f), bias(7, 0.0f);
    std::vector<float> gw(w.size()), gb(bias.size());
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t j = 0; j < kCols; ++j) {
        gw[static_cast<size_t>(i * kCols + j)] = static_cast<float>((r + 1) * (i + 1) * (j % 3 + 1));
      }
    }
    for (size_t i = 0; i < gb.size(); ++i) gb[i] = gradient_value(r, 1, i, 0);
    ReducerOptions o;
    o.compression = parse_compression("powersgd:1");
    o.record_events = true;
    Reducer reducer({{"w", {w.data(), w.size(), DataType::f32, nullptr}, kRows, kCols},
                     {"b", {bias.data(), bias.size(), DataType::f32, nullptr}}},
                    g, o);
    std::vector<float> want_b(gb.size());
    g.all_reduce(gb.data(), want_b.data(), gb.size(), DataType::f32, ReduceOp::avg);
    reducer.mark_ready(1, gb.data());
    reducer.mark_ready(0, gw.data());
    reducer.finish();
    const float* got_w = static_cast<const float*>(reducer.grad(0).data);
    for (size_t i = 0; i < gw.size(); ++i) {
      const float want = gw[i] / static_cast<float>(r + 1) * 1.5f;  // (1 + 2) / 2 u v^T
      ASSERT_NEAR(got_w[i], want, 1e-4 * std::fabs(want) + 1e-4) << "w[" << i << "]";
    }
    const float* got_b = static_cast<const float*>(reducer.grad(1).data);
    for (size_t i = 0; i < gb.size(); ++i) ASSERT_EQ(got_b[i], want_b[i]) << "b[" << i << "]";
    const std::vector<StateEntry> state = reducer.state();
    ASSERT_EQ(state.size(), 2u);
    EXPECT_EQ(state[0].name, "powersgd.q.0");
    EXPECT_EQ(state[0].shape, (std::vector<int64_t>{kCols, 1}));
    EXPECT_EQ(state[1].name, "powersgd.error.0");
    EXPECT_EQ(state[1].shape, (std::vector<int64_t>{kRows, kCols}));
    EXPECT_EQ(reducer.take_events().size(), 1u);  // one exchange after backward, not per bucket
    const CommVolume v = reducer.take_volume();
    EXPECT_GT(v.raw_bytes, 3 * v.wire_bytes);
  });
}

}  // namespace
}  // namespace dtrain::parallel
