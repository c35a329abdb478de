// Layout search (plan.h): every dp x pp x tp factorisation of the devices with its ZeRO stages,
// micro-batch counts and recompute, simulated and ranked.
#include <algorithm>
#include <limits>

#include "dtrain/core/error.h"
#include "dtrain/plan/plan.h"

namespace dtrain::plan {

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t k = 1; k * k <= n; ++k) {
    if (n % k != 0) continue;
    d.push_back(k);
    if (k != n / k) d.push_back(n / k);
  }
  std::sort(d.begin(), d.end());
  return d;
}

bool power_of_two(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

}  // namespace

SearchResult search(const ModelSpec& model, const Hardware& hw, int64_t batch, const Layout& base,
                    const SearchOptions& o) {
  DT_CHECK(o.devices >= 1, "plan", "--devices {} must be at least 1", o.devices);
  DT_CHECK(batch > 0, "plan", "--batch-size must be positive, got {}", batch);
  SearchResult out;
  const int64_t blocks = static_cast<int64_t>(model.blocks.size());
  for (int64_t tp : divisors(o.devices)) {
    if (tp > 1 && (model.heads == 0 || model.heads % tp != 0 || model.width % tp != 0)) continue;
    for (int64_t pp : divisors(o.devices / tp)) {
      if (pp > blocks) continue;
      const int64_t dp = o.devices / tp / pp;
      if (batch % dp != 0) continue;
      const int64_t per_replica = batch / dp;
      // Micro-batches (pipelines) or accumulation steps (no pipeline): divisors of the replica's
      // batch, powers of two or multiples of the stages, up to the limit.
      std::vector<int64_t> counts;
      for (int64_t m : divisors(per_replica)) {
        if (m <= o.max_micro_batches && (power_of_two(m) || m % pp == 0)) counts.push_back(m);
      }
      for (int zero : o.zero) {
        if (zero > 0 && (dp == 1 || base.optimizer_state == "int8")) continue;
        for (int64_t m : counts) {
          // Accumulation and recompute only buy memory: tried under a memory limit.
          if (pp == 1 && m > 1 && hw.memory <= 0) continue;
          for (int rc = 0; rc < (o.try_recompute && hw.memory > 0 ? 2 : 1); ++rc) {
            for (int g = 0; g < (o.try_gpipe && pp > 1 ? 2 : 1); ++g) {
              Layout l = base;
              l.stages.clear();
              l.dp = static_cast<int>(dp);
              l.pp = static_cast<int>(pp);
              l.tp = static_cast<int>(tp);
              l.zero = zero;
              l.micro_batches = pp > 1 ? m : 1;
              l.accumulate = pp > 1 ? 1 : m;
              l.recompute = rc == 1;
              l.schedule = g == 1 ? parallel::Schedule::gpipe : parallel::Schedule::one_f_one_b;
              Prediction p = predict_if_fits(model, hw, l, batch);
              ++out.considered;
              if (!p.fits) {
                ++out.too_big;
                continue;
              }
              out.ranked.push_back(std::move(p));
            }
          }
        }
      }
    }
  }
  // Fastest first; at equal time (within 0.1%) the smaller memory, then fewer devices per replica.
  std::stable_sort(out.ranked.begin(), out.ranked.end(), [](const Prediction& a, const Prediction& b) {
    if (std::abs(a.step_s - b.step_s) > 1e-3 * std::max(a.step_s, b.step_s)) return a.step_s < b.step_s;
    return a.memory.total() < b.memory.total();
  });
  return out;
}

}  // namespace dtrain::plan
