#include "dtrain/optim/optim.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "dtrain/core/error.h"
#include "dtrain/optim/offload.h"
#include "dtrain/optim/quantize.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/kernels.h"

namespace dtrain::optim {

void Optimizer::zero_grad() {
  for (auto& p : params_) p.zero_grad();
}

Tensor Optimizer::new_state(const std::string& name, const Shape& shape, DType dtype) const {
  return storage_ ? storage_->allocate(name, shape, dtype) : Tensor::zeros(shape, dtype);
}

Tensor Optimizer::stored_copy(const std::string& name, const Tensor& t) const {
  if (!storage_) return t.clone();
  Tensor s = storage_->allocate(name, t.shape(), t.dtype());
  s.copy_from(t);
  return s;
}

void Optimizer::release(const Tensor& t, int64_t offset, int64_t count) const {
  if (!storage_ || count <= 0) return;
  const size_t es = dtype_size(t.dtype());
  storage_->release(static_cast<char*>(const_cast<Tensor&>(t).raw_data()) + static_cast<size_t>(offset) * es,
                    static_cast<size_t>(count) * es);
}

Sgd::Sgd(std::vector<Tensor> params, float lr, float momentum, float weight_decay, bool nesterov)
    : Optimizer(std::move(params)), momentum_(momentum), weight_decay_(weight_decay), nesterov_(nesterov) {
  DT_CHECK(lr >= 0.0f && momentum >= 0.0f && weight_decay >= 0.0f, "optim",
           "SGD: lr {}, momentum {} and weight decay {} must be non-negative", lr, momentum, weight_decay);
  lr_ = lr;
  momentum_buf_.resize(params_.size());
}

void Sgd::step() {
  NoGradGuard no_grad;
  ++step_count_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    float* p = params_[i].data();
    const float* pg = g.data();
    const int64_t n = params_[i].numel();
    if (momentum_ == 0.0f) {
      for (int64_t j = 0; j < n; ++j) p[j] -= lr_ * (pg[j] + weight_decay_ * p[j]);
      continue;
    }
    const bool first = !momentum_buf_[i].defined();
    if (first) momentum_buf_[i] = Tensor::empty(params_[i].shape());
    float* buf = momentum_buf_[i].data();
    for (int64_t j = 0; j < n; ++j) {
      const float d = pg[j] + weight_decay_ * p[j];
      buf[j] = first ? d : momentum_ * buf[j] + d;
      p[j] -= lr_ * (nesterov_ ? d + momentum_ * buf[j] : buf[j]);
    }
  }
}

std::vector<nn::NamedTensor> Sgd::state() const {
  std::vector<nn::NamedTensor> out;
  for (size_t i = 0; i < momentum_buf_.size(); ++i) {
    if (momentum_buf_[i].defined()) out.emplace_back("momentum." + std::to_string(i), momentum_buf_[i]);
  }
  return out;
}

namespace {

// "exp_avg.3" -> 3 when the name starts with `prefix` and the index is a parameter's.
int state_index(const std::string& name, const std::string& prefix, size_t params) {
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return -1;
  size_t used = 0;
  unsigned long i = 0;
  try {
    i = std::stoul(name.substr(prefix.size()), &used);
  } catch (const std::exception&) {
    return -1;
  }
  return used == name.size() - prefix.size() && i < params ? static_cast<int>(i) : -1;
}

Tensor restored(const std::string& name, const Tensor& saved, const Tensor& param) {
  DT_CHECK(saved.shape() == param.shape(), "optim", "optimizer state '{}' has shape {} but its parameter {}", name,
           shape_str(saved.shape()), shape_str(param.shape()));
  return saved.clone();
}

}  // namespace

void Sgd::load_state(const std::vector<nn::NamedTensor>& state, const std::vector<int64_t>& counters) {
  DT_CHECK(counters.size() == 1 && counters[0] >= 0, "optim", "SGD state: {} counters, expected 1", counters.size());
  std::vector<Tensor> bufs(params_.size());
  for (const auto& [name, t] : state) {
    const int i = state_index(name, "momentum.", params_.size());
    DT_CHECK(i >= 0, "optim", "SGD state has an unknown tensor '{}' ({} parameters)", name, params_.size());
    bufs[static_cast<size_t>(i)] = restored(name, t, params_[static_cast<size_t>(i)]);
  }
  momentum_buf_ = std::move(bufs);
  step_count_ = counters[0];
}

StateFormat parse_state_format(const std::string& name) {
  if (name == "f32") return StateFormat::f32;
  if (name == "int8") return StateFormat::int8;
  DT_THROW("optim", "optimizer state format '{}': expected f32 or int8", name);
}

const char* state_format_name(StateFormat format) { return format == StateFormat::int8 ? "int8" : "f32"; }

int64_t state_bytes(const Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& [name, t] : optimizer.state()) bytes += t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
  return bytes;
}

AdamW::AdamW(std::vector<Tensor> params, float lr, float beta1, float beta2, float eps, float weight_decay,
             StateFormat format)
    : Optimizer(std::move(params)),
      beta1_(beta1),
      beta2_(beta2),
      eps_(eps),
      weight_decay_(weight_decay),
      format_(format) {
  DT_CHECK(lr >= 0.0f && beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f && eps > 0.0f, "optim",
           "AdamW: invalid lr {}, betas ({}, {}) or eps {}", lr, beta1, beta2, eps);
  lr_ = lr;
  exp_avg_.resize(params_.size());
  exp_avg_sq_.resize(params_.size());
  avg_scale_.resize(params_.size());
  sq_scale_.resize(params_.size());
  steps_.assign(params_.size(), 0);
}

void AdamW::step() {
  NoGradGuard no_grad;
  ++step_count_;
  const auto update = shared_params_ ? kernels::table().adamw_stream : kernels::table().adamw;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    if (!exp_avg_[i].defined()) {
      const std::string index = std::to_string(i);
      if (format_ == StateFormat::int8) {
        const int64_t blocks = quant_blocks(params_[i].numel());
        exp_avg_[i] = new_state("exp_avg_q8." + index, params_[i].shape(), DType::u8);
        exp_avg_sq_[i] = new_state("exp_avg_sq_q8." + index, params_[i].shape(), DType::u8);
        avg_scale_[i] = new_state("exp_avg_scale." + index, {blocks});
        sq_scale_[i] = new_state("exp_avg_sq_scale." + index, {blocks});
      } else {
        exp_avg_[i] = new_state("exp_avg." + index, params_[i].shape());
        exp_avg_sq_[i] = new_state("exp_avg_sq." + index, params_[i].shape());
      }
    }
    const int64_t t = ++steps_[i];
    const float bc1 = 1.0f - std::pow(beta1_, static_cast<float>(t));
    const float bc2 = 1.0f - std::pow(beta2_, static_cast<float>(t));
    const float step_size = lr_ / bc1;
    const float inv_bc2_sqrt = 1.0f / std::sqrt(bc2);
    const float decay = 1.0f - lr_ * weight_decay_;
    if (format_ == StateFormat::int8) {
      step_int8(i, g.data(), decay, step_size, inv_bc2_sqrt);
      continue;
    }
    // In chunks (whole vectors of the kernel: the same bits as one call), each handed back to
    // the storage when done: offloaded state stays out of memory but for one chunk.
    const int64_t n = params_[i].numel();
    const int64_t chunk = storage_ ? kOffloadChunk : std::max<int64_t>(n, 1);
    for (int64_t off = 0; off < n; off += chunk) {
      const int64_t len = std::min(chunk, n - off);
      update(params_[i].data() + off, g.data() + off, exp_avg_[i].data() + off, exp_avg_sq_[i].data() + off, len, decay,
             beta1_, beta2_, step_size, inv_bc2_sqrt, eps_);
      release(exp_avg_[i], off, len);
      release(exp_avg_sq_[i], off, len);
    }
  }
}

void AdamW::step_int8(size_t i, const float* g, float decay, float step_size, float inv_bc2_sqrt) {
  const auto update = shared_params_ ? kernels::table().adamw_stream : kernels::table().adamw;
  float* p = params_[i].data();
  auto* m_codes = static_cast<uint8_t*>(exp_avg_[i].raw_data());
  auto* v_codes = static_cast<uint8_t*>(exp_avg_sq_[i].raw_data());
  float* m_scale = avg_scale_[i].data();
  float* v_scale = sq_scale_[i].data();
  alignas(64) float m[kQuantBlock];
  alignas(64) float v[kQuantBlock];
  const int64_t n = params_[i].numel();
  for (int64_t b = 0, off = 0; off < n; ++b, off += kQuantBlock) {
    const int64_t len = std::min(kQuantBlock, n - off);
    dequantize_block(QuantCode::kSigned, m_codes + off, len, m_scale[b], m);
    dequantize_block(QuantCode::kUnsignedSqrt, v_codes + off, len, v_scale[b], v);
    update(p + off, g + off, m, v, len, decay, beta1_, beta2_, step_size, inv_bc2_sqrt, eps_);
    v_scale[b] = quantize_block(QuantCode::kUnsignedSqrt, v, len, v_codes + off);
    for (int64_t j = 0; j < len; ++j) {
      if (v_codes[off + j] == 0) m[j] = 0.0f;
    }
    m_scale[b] = quantize_block(QuantCode::kSigned, m, len, m_codes + off);
    // Offloaded: a chunk's codes and scales go back to the storage when its last block is done.
    const int64_t end = off + len;
    if (end % kOffloadChunk == 0 || end == n) {
      const int64_t start = (end - 1) / kOffloadChunk * kOffloadChunk;
      release(exp_avg_[i], start, end - start);
      release(exp_avg_sq_[i], start, end - start);
      release(avg_scale_[i], start / kQuantBlock, quant_blocks(end) - start / kQuantBlock);
      release(sq_scale_[i], start / kQuantBlock, quant_blocks(end) - start / kQuantBlock);
    }
  }
}

std::vector<nn::NamedTensor> AdamW::state() const {
  std::vector<nn::NamedTensor> out;
  const bool q8 = format_ == StateFormat::int8;
  for (size_t i = 0; i < exp_avg_.size(); ++i) {
    if (!exp_avg_[i].defined()) continue;
    const std::string index = std::to_string(i);
    out.emplace_back((q8 ? "exp_avg_q8." : "exp_avg.") + index, exp_avg_[i]);
    out.emplace_back((q8 ? "exp_avg_sq_q8." : "exp_avg_sq.") + index, exp_avg_sq_[i]);
    if (!q8) continue;
    out.emplace_back("exp_avg_scale." + index, avg_scale_[i]);
    out.emplace_back("exp_avg_sq_scale." + index, sq_scale_[i]);
  }
  return out;
}

std::vector<int64_t> AdamW::counters() const {
  std::vector<int64_t> c{step_count_};
  c.insert(c.end(), steps_.begin(), steps_.end());
  return c;
}

namespace {

// One parameter's saved AdamW state in either format.
struct SavedMoments {
  Tensor m, v;                // f32
  Tensor m_q, v_q, m_s, v_s;  // int8: codes and scales
  bool any() const {
    return m.defined() || v.defined() || m_q.defined() || v_q.defined() || m_s.defined() || v_s.defined();
  }
};

Tensor checked_codes(const std::string& what, const Tensor& t, const Tensor& param) {
  DT_CHECK(t.dtype() == DType::u8 && t.shape() == param.shape(), "optim",
           "optimizer state '{}' is {} {} but its parameter {} needs u8 codes of that shape", what,
           dtype_name(t.dtype()), shape_str(t.shape()), shape_str(param.shape()));
  return t.clone();
}

Tensor checked_scales(const std::string& what, const Tensor& t, const Tensor& param) {
  const Shape want{quant_blocks(param.numel())};
  DT_CHECK(t.dtype() == DType::f32 && t.shape() == want, "optim",
           "optimizer state '{}' is {} {} but its parameter {} needs f32 scales {}", what, dtype_name(t.dtype()),
           shape_str(t.shape()), shape_str(param.shape()), shape_str(want));
  return t.clone();
}

// f32 moments -> codes and scales (per block).
void quantize_tensor(QuantCode code, const Tensor& x, Tensor& codes, Tensor& scales) {
  const Tensor c = x.contiguous();
  const int64_t n = c.numel();
  codes = Tensor::empty(x.shape(), DType::u8);
  scales = Tensor::empty({quant_blocks(n)});
  auto* q = static_cast<uint8_t*>(codes.raw_data());
  for (int64_t b = 0, off = 0; off < n; ++b, off += kQuantBlock) {
    scales.data()[b] = quantize_block(code, c.data() + off, std::min(kQuantBlock, n - off), q + off);
  }
}

Tensor dequantize_tensor(QuantCode code, const Tensor& codes, const Tensor& scales) {
  Tensor x = Tensor::empty(codes.shape());
  const int64_t n = x.numel();
  const auto* q = static_cast<const uint8_t*>(codes.raw_data());
  for (int64_t b = 0, off = 0; off < n; ++b, off += kQuantBlock) {
    dequantize_block(code, q + off, std::min(kQuantBlock, n - off), scales.data()[b], x.data() + off);
  }
  return x;
}

}  // namespace

void AdamW::load_state(const std::vector<nn::NamedTensor>& state, const std::vector<int64_t>& counters) {
  DT_CHECK(counters.size() == params_.size() + 1, "optim", "AdamW state: {} counters, expected {} (1 + parameters)",
           counters.size(), params_.size() + 1);
  std::vector<SavedMoments> saved(params_.size());
  // Kind prefixes and where each goes; "exp_avg." cannot match "exp_avg_sq.3" (the dot).
  const std::pair<const char*, Tensor SavedMoments::*> kinds[] = {
      {"exp_avg.", &SavedMoments::m},         {"exp_avg_sq.", &SavedMoments::v},
      {"exp_avg_q8.", &SavedMoments::m_q},    {"exp_avg_sq_q8.", &SavedMoments::v_q},
      {"exp_avg_scale.", &SavedMoments::m_s}, {"exp_avg_sq_scale.", &SavedMoments::v_s}};
  for (const auto& [name, t] : state) {
    bool known = false;
    for (const auto& [prefix, member] : kinds) {
      const int i = state_index(name, prefix, params_.size());
      if (i < 0) continue;
      saved[static_cast<size_t>(i)].*member = t;
      known = true;
      break;
    }
    DT_CHECK(known, "optim", "AdamW state has an unknown tensor '{}' ({} parameters)", name, params_.size());
  }
  std::vector<Tensor> m(params_.size()), v(params_.size()), ms(params_.size()), vs(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const SavedMoments& s = saved[i];
    const Tensor& p = params_[i];
    const std::string index = std::to_string(i);
    const bool f32 = s.m.defined() && s.v.defined();
    const bool q8 = s.m_q.defined() && s.v_q.defined() && s.m_s.defined() && s.v_s.defined();
    DT_CHECK(!s.any() || f32 != q8, "optim",
             "AdamW state of parameter {} is incomplete (expected exp_avg and exp_avg_sq, or the four int8 tensors)",
             i);
    DT_CHECK(s.any() || counters[i + 1] == 0, "optim", "AdamW state of parameter {} is incomplete", i);
    if (!s.any()) continue;
    if (f32) {
      Tensor fm = restored("exp_avg." + index, s.m, p), fv = restored("exp_avg_sq." + index, s.v, p);
      if (format_ == StateFormat::f32) {
        m[i] = fm;
        v[i] = fv;
      } else {
        quantize_tensor(QuantCode::kSigned, fm, m[i], ms[i]);
        quantize_tensor(QuantCode::kUnsignedSqrt, fv, v[i], vs[i]);
      }
      continue;
    }
    Tensor qm = checked_codes("exp_avg_q8." + index, s.m_q, p), qv = checked_codes("exp_avg_sq_q8." + index, s.v_q, p);
    Tensor sm = checked_scales("exp_avg_scale." + index, s.m_s, p);
    Tensor sv = checked_scales("exp_avg_sq_scale." + index, s.v_s, p);
    if (format_ == StateFormat::int8) {
      m[i] = qm;
      v[i] = qv;
      ms[i] = sm;
      vs[i] = sv;
    } else {
      m[i] = dequantize_tensor(QuantCode::kSigned, qm, sm);
      v[i] = dequantize_tensor(QuantCode::kUnsignedSqrt, qv, sv);
    }
  }
  // Into the storage (offloaded: the files) under the names state() gives them.
  const bool q8 = format_ == StateFormat::int8;
  for (size_t i = 0; storage_ && i < params_.size(); ++i) {
    if (!m[i].defined()) continue;
    const std::string index = std::to_string(i);
    m[i] = stored_copy((q8 ? "exp_avg_q8." : "exp_avg.") + index, m[i]);
    v[i] = stored_copy((q8 ? "exp_avg_sq_q8." : "exp_avg_sq.") + index, v[i]);
    if (!q8) continue;
    ms[i] = stored_copy("exp_avg_scale." + index, ms[i]);
    vs[i] = stored_copy("exp_avg_sq_scale." + index, vs[i]);
  }
  exp_avg_ = std::move(m);
  exp_avg_sq_ = std::move(v);
  avg_scale_ = std::move(ms);
  sq_scale_ = std::move(vs);
  step_count_ = counters[0];
  steps_.assign(counters.begin() + 1, counters.end());
}

float LrSchedule::at(int64_t step) const {
  if (warmup > 0 && step < warmup) return base_lr * static_cast<float>(step + 1) / static_cast<float>(warmup);
  if (!cosine) return base_lr;
  const int64_t span = std::max<int64_t>(total - warmup, 1);
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(span));
  return min_lr + static_cast<float>(0.5 * (1.0 + std::cos(M_PI * progress))) * (base_lr - min_lr);
}

double grad_square_sum(const std::vector<Tensor>& params) {
  double sq = 0.0;
  for (const auto& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    const float* pg = g.data();
    for (int64_t j = 0, n = g.numel(); j < n; ++j) sq += static_cast<double>(pg[j]) * pg[j];
  }
  return sq;
}

void scale_grads(const std::vector<Tensor>& params, float factor) {
  for (const auto& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    float* pg = g.data();
    for (int64_t j = 0, n = g.numel(); j < n; ++j) pg[j] *= factor;
  }
}

float clip_grad_norm(const std::vector<Tensor>& params, float max_norm) {
  const auto norm = static_cast<float>(std::sqrt(grad_square_sum(params)));
  if (max_norm > 0.0f && norm > max_norm) scale_grads(params, max_norm / (norm + 1e-6f));
  return norm;
}

}  // namespace dtrain::optim
