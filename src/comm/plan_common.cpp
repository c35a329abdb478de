// Algorithm names, the per-size choice, argument checks, and the dispatch from the public
// plan_* functions to the algorithm files (plan_ring.cpp, plan_halving_doubling.cpp,
// plan_recursive_doubling.cpp, plan_tree.cpp, plan_pairwise.cpp).
#include "plan_common.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <initializer_list>

#include "dtrain/core/error.h"

namespace dtrain::comm {

namespace detail {

std::vector<size_t> prefix_sums(const std::vector<size_t>& counts) {
  std::vector<size_t> offsets(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) offsets[i + 1] = offsets[i] + counts[i];
  return offsets;
}

std::vector<size_t> even_counts(size_t count, int parts) {
  const auto p = static_cast<size_t>(parts);
  std::vector<size_t> counts(p, count / p);
  for (size_t i = 0; i < count % p; ++i) ++counts[i];
  return counts;
}

int ceil_log2(int n) {
  int l = 0;
  while ((1 << l) < n) ++l;
  return l;
}

Fold::Fold(int world) : size(world), p2(1), extra(0), log2_p2(0) {
  while (p2 * 2 <= world) {
    p2 *= 2;
    ++log2_p2;
  }
  extra = world - p2;
}

}  // namespace detail

namespace {

constexpr Algorithm kAllAlgorithms[] = {Algorithm::automatic,          Algorithm::ring,     Algorithm::halving_doubling,
                                        Algorithm::recursive_doubling, Algorithm::binomial, Algorithm::linear,
                                        Algorithm::pairwise,           Algorithm::direct,   Algorithm::hierarchical};

// Measured crossover points for choose_all_reduce, in bytes per rank. Placeholders from the
// cost model (recursive doubling pays lg(p) * n in bandwidth, halving-doubling has 2 lg(p)
// latency terms against the ring's 2(p-1), the ring wins for large vectors through segment
// pipelining and cache-sized scratch); bench/ re-measures them and they will move.
constexpr size_t kAllReduceRecursiveDoublingMaxBytes = size_t{16} * 1024;
constexpr size_t kAllReduceHalvingDoublingMaxBytes = size_t{512} * 1024;
constexpr size_t kTwoRankRecursiveDoublingMaxBytes = size_t{256} * 1024;

// plan_all_reduce(automatic) sees elements, not bytes: it assumes 4-byte elements. Callers that
// know the dtype call choose_all_reduce themselves and pass the result.
constexpr size_t kAssumedElementBytes = 4;

std::string names_of(std::initializer_list<Algorithm> algorithms) {
  std::vector<std::string> names;
  for (Algorithm a : algorithms) names.emplace_back(name_of(a));
  return fmt::format("{}", fmt::join(names, ", "));
}

[[noreturn]] void not_applicable(Algorithm a, const char* collective, std::initializer_list<Algorithm> valid) {
  DT_THROW("comm", "algorithm '{}' does not apply to {} (valid: {})", name_of(a), collective, names_of(valid));
}

void check_rank(const char* collective, int rank, int size) {
  DT_CHECK(size >= 1, "comm", "{}: world size must be at least 1, got {}", collective, size);
  DT_CHECK(rank >= 0 && rank < size, "comm", "{}: rank {} is outside [0, {})", collective, rank, size);
}

void check_root(const char* collective, int root, int size) {
  DT_CHECK(root >= 0 && root < size, "comm", "{}: root {} is outside [0, {})", collective, root, size);
}

void check_counts(const char* collective, const std::vector<size_t>& counts, int size) {
  DT_CHECK(counts.size() == static_cast<size_t>(size), "comm", "{}: {} counts for a world of {} ranks (expected {})",
           collective, counts.size(), size, size);
}

}  // namespace

const char* name_of(Algorithm a) {
  switch (a) {
    case Algorithm::automatic:
      return "auto";
    case Algorithm::ring:
      return "ring";
    case Algorithm::halving_doubling:
      return "hd";
    case Algorithm::recursive_doubling:
      return "rd";
    case Algorithm::binomial:
      return "tree";
    case Algorithm::linear:
      return "linear";
    case Algorithm::pairwise:
      return "pairwise";
    case Algorithm::direct:
      return "direct";
    case Algorithm::hierarchical:
      return "hier";
  }
  return "?";
}

Algorithm parse_algorithm(const std::string& text) {
  for (Algorithm a : kAllAlgorithms) {
    if (text == name_of(a)) return a;
  }
  std::vector<std::string> names;
  for (Algorithm a : kAllAlgorithms) names.emplace_back(name_of(a));
  DT_THROW("comm", "unknown algorithm '{}' (expected one of: {})", text, fmt::join(names, ", "));
}

Algorithm choose_all_reduce(size_t bytes, int size) {
  // 2 ranks over TCP loopback (dtrain bench collectives --transport tcp --algo ring,hd,rd):
  // rd fastest up to 64 KiB (65 us vs ring 90, hd 109), hd from 1 MiB (409 us vs rd 442, ring
  // 712; 16 MiB: hd 12.6 ms, rd 16.1, ring 18.0).
  if (size <= 2)
    return bytes <= kTwoRankRecursiveDoublingMaxBytes ? Algorithm::recursive_doubling : Algorithm::halving_doubling;
  if (bytes <= kAllReduceRecursiveDoublingMaxBytes) return Algorithm::recursive_doubling;
  if (bytes <= kAllReduceHalvingDoublingMaxBytes) return Algorithm::halving_doubling;
  return Algorithm::ring;
}

Plan plan_all_reduce(Algorithm a, int rank, int size, size_t count) {
  check_rank("all_reduce", rank, size);
  if (a == Algorithm::automatic) a = choose_all_reduce(count * kAssumedElementBytes, size);
  switch (a) {
    case Algorithm::ring:
      return detail::plan_ring_all_reduce(rank, size, count);
    case Algorithm::halving_doubling:
      return detail::plan_hd_all_reduce(rank, size, count);
    case Algorithm::recursive_doubling:
      return detail::plan_rd_all_reduce(rank, size, count);
    default:
      not_applicable(
          a, "all_reduce",
          {Algorithm::automatic, Algorithm::ring, Algorithm::halving_doubling, Algorithm::recursive_doubling});
  }
}

Plan plan_reduce_scatter(Algorithm a, int rank, int size, const std::vector<size_t>& counts) {
  check_rank("reduce_scatter", rank, size);
  check_counts("reduce_scatter", counts, size);
  switch (a) {
    case Algorithm::automatic:
    case Algorithm::ring:
      return detail::plan_ring_reduce_scatter(rank, size, counts);
    case Algorithm::halving_doubling:
      return detail::plan_hd_reduce_scatter(rank, size, counts);
    default:
      not_applicable(a, "reduce_scatter", {Algorithm::automatic, Algorithm::ring, Algorithm::halving_doubling});
  }
}

Plan plan_all_gather(Algorithm a, int rank, int size, const std::vector<size_t>& counts) {
  check_rank("all_gather", rank, size);
  check_counts("all_gather", counts, size);
  switch (a) {
    case Algorithm::automatic:
    case Algorithm::ring:
      return detail::plan_ring_all_gather(rank, size, counts);
    // Recursive doubling is the all-gather half of halving-doubling: both names select it.
    case Algorithm::halving_doubling:
    case Algorithm::recursive_doubling:
      return detail::plan_rd_all_gather(rank, size, counts);
    default:
      not_applicable(
          a, "all_gather",
          {Algorithm::automatic, Algorithm::ring, Algorithm::halving_doubling, Algorithm::recursive_doubling});
  }
}

Plan plan_broadcast(Algorithm a, int rank, int size, size_t count, int root) {
  check_rank("broadcast", rank, size);
  check_root("broadcast", root, size);
  switch (a) {
    case Algorithm::automatic:
    case Algorithm::binomial:
      return detail::plan_tree_broadcast(rank, size, count, root);
    case Algorithm::linear:
      return detail::plan_linear_broadcast(rank, size, count, root);
    default:
      not_applicable(a, "broadcast", {Algorithm::automatic, Algorithm::binomial, Algorithm::linear});
  }
}

Plan plan_reduce(Algorithm a, int rank, int size, size_t count, int root) {
  check_rank("reduce", rank, size);
  check_root("reduce", root, size);
  switch (a) {
    case Algorithm::automatic:
    case Algorithm::binomial:
      return detail::plan_tree_reduce(rank, size, count, root);
    case Algorithm::linear:
      return detail::plan_linear_reduce(rank, size, count, root);
    default:
      not_applicable(a, "reduce", {Algorithm::automatic, Algorithm::binomial, Algorithm::linear});
  }
}

Plan plan_gather(Algorithm a, int rank, int size, const std::vector<size_t>& counts, int root) {
  check_rank("gather", rank, size);
  check_root("gather", root, size);
  check_counts("gather", counts, size);
  switch (a) {
    case Algorithm::automatic:
    case Algorithm::binomial:
      return detail::plan_tree_gather(rank, size, counts, root);
    case Algorithm::linear:
      return detail::plan_linear_gather(rank, size, counts, root);
    default:
      not_applicable(a, "gather", {Algorithm::automatic, Algorithm::binomial, Algorithm::linear});
  }
}

Plan plan_scatter(Algorithm a, int rank, int size, const std::vector<size_t>& counts, int root) {
  check_rank("scatter", rank, size);
  check_root("scatter", root, size);
  check_counts("scatter", counts, size);
  switch (a) {
    case Algorithm::automatic:
    case Algorithm::binomial:
      return detail::plan_tree_scatter(rank, size, counts, root);
    case Algorithm::linear:
      return detail::plan_linear_scatter(rank, size, counts, root);
    default:
      not_applicable(a, "scatter", {Algorithm::automatic, Algorithm::binomial, Algorithm::linear});
  }
}

Plan plan_all_to_all(Algorithm a, int rank, int size, size_t count_per_rank) {
  check_rank("all_to_all", rank, size);
  switch (a) {
    case Algorithm::automatic:
    case Algorithm::pairwise:
      return detail::plan_pairwise_all_to_all(rank, size, count_per_rank);
    default:
      not_applicable(a, "all_to_all", {Algorithm::automatic, Algorithm::pairwise});
  }
}

Plan plan_barrier(int rank, int size) {
  check_rank("barrier", rank, size);
  return detail::plan_dissemination_barrier(rank, size);
}

}  // namespace dtrain::comm
