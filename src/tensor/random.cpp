#include "dtrain/tensor/random.h"

#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>

#include "dtrain/core/error.h"

namespace dtrain {

uint64_t Generator::below(uint64_t n) {
  DT_CHECK(n > 0, "tensor", "Generator::below(0)");
  // Rejection sampling keeps the draw unbiased.
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t r;
  do {
    r = engine_();
  } while (r >= limit);
  return r % n;
}

float Generator::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  double u1;
  do {
    u1 = static_cast<double>(engine_() >> 11) * (1.0 / 9007199254740992.0);
  } while (u1 <= 0.0);
  const double u2 = static_cast<double>(engine_() >> 11) * (1.0 / 9007199254740992.0);
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double theta = 2.0 * M_PI * u2;
  spare_ = static_cast<float>(r * std::sin(theta));
  has_spare_ = true;
  return static_cast<float>(r * std::cos(theta));
}

std::string Generator::state() const {
  std::ostringstream os;
  // max_digits10 so that the spare normal survives the text round trip bit for bit.
  os << std::setprecision(std::numeric_limits<float>::max_digits10) << engine_ << ' ' << (has_spare_ ? 1 : 0) << ' '
     << spare_;
  return os.str();
}

void Generator::set_state(const std::string& state) {
  std::istringstream is(state);
  int spare_flag = 0;
  is >> engine_ >> spare_flag >> spare_;
  DT_CHECK(!is.fail(), "tensor", "malformed generator state ({} bytes)", state.size());
  has_spare_ = spare_flag != 0;
}

}  // namespace dtrain
