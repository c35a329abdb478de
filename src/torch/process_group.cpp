// ProcessGroupDtrain: c10d's operations as dtrain collectives on (pointer, count, dtype) buffers.
//
// Vocabulary: the caller's tensor is the *user* tensor; the *dense* tensor is the contiguous
// one dtrain reads or writes (the user tensor itself when it is contiguous and of a dtype
// dtrain knows, else a copy whose result the *epilogue* copies back). A *flat* tensor packs a
// list of tensors into one buffer (all_gather's outputs, scatter's inputs, ...).
#include "dtrain/torch/process_group.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dtrain/comm/compressed.h"
#include "dtrain/core/error.h"
#include "dtrain/core/log.h"
#include "fault.h"
#include "work.h"

namespace dtrain::torch_backend {
namespace {

using c10d::OpType;

std::string device_text(const at::Tensor& t) {
  std::ostringstream s;
  s << t.device();
  return s.str();
}

void check_tensor(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "dtrain ", op, ": ", what, " is an undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), "dtrain ", op, ": ", what, " is on device '", device_text(t),
                    "'; the dtrain backend works on CPU tensors only (move it with .cpu(), or use NCCL for GPUs)");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "dtrain ", op, ": ", what, " has layout ", t.layout(),
                    "; the dtrain backend works on dense (strided) tensors only");
}

// Where this rank's TCP transport listens, which matters when the ranks span hosts: what
// DTRAIN_BIND_ADDR says, else comm::address_toward the store the ranks met through: torch's
// TCPStore under its PrefixStores (torchrun, env://, tcp://), or under dtrain launch its store at
// MASTER_ADDR (the client dtrain_torch connects is not a TCPStore). Empty (loopback) for other
// stores (file://) and when no route is found: a group across hosts then says to set
// DTRAIN_BIND_ADDR.
std::string bind_address(const c10::intrusive_ptr<c10d::Store>& store) {
  if (const char* bind = std::getenv("DTRAIN_BIND_ADDR"); bind != nullptr && *bind != '\0') return bind;
  c10d::Store* s = store.get();
  while (auto* prefix = dynamic_cast<c10d::PrefixStore*>(s)) s = prefix->getUnderlyingStore().get();
  std::string host;
  int port = 0;
  const char* hosted = std::getenv("DTRAIN_STORE_HOSTED");
  if (const auto* tcp = dynamic_cast<const c10d::TCPStore*>(s); tcp != nullptr) {
    host = tcp->getHost();
    port = tcp->getPort();
  } else if (const char* addr = std::getenv("MASTER_ADDR");
             hosted != nullptr && std::string(hosted) == "1" && addr != nullptr && *addr != '\0') {
    host = addr;  // the port only picks the route: 0 where MASTER_PORT is not a port
    const char* p = std::getenv("MASTER_PORT");
    char* end = nullptr;
    const long v = p != nullptr ? std::strtol(p, &end, 10) : 0;
    port = p != nullptr && end != p && *end == '\0' && v > 0 && v < 65536 ? static_cast<int>(v) : 0;
  }
  if (host.empty()) return "";
  try {
    return comm::address_toward(host, port);
  } catch (const Error& e) {
    DT_LOG_WARN("dtrain backend: {}; listening on 127.0.0.1, which ranks on other hosts cannot reach", e.what());
    return "";
  }
}

std::optional<comm::DataType> dtrain_dtype(at::ScalarType s) {
  switch (s) {
    case at::kFloat:
      return comm::DataType::f32;
    case at::kDouble:
      return comm::DataType::f64;
    case at::kHalf:
      return comm::DataType::f16;
    case at::kBFloat16:
      return comm::DataType::bf16;
    case at::kInt:
      return comm::DataType::i32;
    case at::kLong:
      return comm::DataType::i64;
    case at::kByte:
      return comm::DataType::u8;
    default:
      return std::nullopt;
  }
}

const char* c10d_op_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "UNKNOWN";
  }
}

// bool reduces as uint8 holding 0 or 1: sum and max are "or", product and min "and", so the
// result stays 0 or 1 (gloo's bool sum and product give the same).
comm::ReduceOp reduce_op(const c10d::ReduceOp& op, at::ScalarType s, const char* name) {
  const auto kind = static_cast<c10d::ReduceOp::RedOpType>(op);
  if (s == at::kBool) {
    switch (kind) {
      case c10d::ReduceOp::SUM:
      case c10d::ReduceOp::MAX:
      case c10d::ReduceOp::BOR:
        return comm::ReduceOp::max;
      case c10d::ReduceOp::PRODUCT:
      case c10d::ReduceOp::MIN:
      case c10d::ReduceOp::BAND:
        return comm::ReduceOp::min;
      default:
        break;
    }
    TORCH_CHECK_VALUE(false, "dtrain ", name, ": ReduceOp.", c10d_op_name(kind),
                      " is not defined for bool tensors (supported: SUM, PRODUCT, MIN, MAX, BAND, BOR)");
  }
  switch (kind) {
    case c10d::ReduceOp::SUM:
      return comm::ReduceOp::sum;
    case c10d::ReduceOp::AVG:
      return comm::ReduceOp::avg;
    case c10d::ReduceOp::PRODUCT:
      return comm::ReduceOp::prod;
    case c10d::ReduceOp::MIN:
      return comm::ReduceOp::min;
    case c10d::ReduceOp::MAX:
      return comm::ReduceOp::max;
    default:
      break;
  }
  TORCH_CHECK_VALUE(false, "dtrain ", name, ": ReduceOp.", c10d_op_name(kind),
                    " is not supported by the dtrain backend (supported: SUM, AVG, PRODUCT, MIN, MAX)");
}

// A tensor as dtrain sees it (see the vocabulary above).
struct Buf {
  at::Tensor user;
  at::Tensor dense;
  comm::DataType dtype = comm::DataType::u8;
  size_t count = 0;
  bool copied = false;
  void* data() const { return dense.data_ptr(); }
  void copy_back() const {
    if (copied) user.copy_(dense);
  }
};

at::Tensor contiguous_or_copy(const at::Tensor& t, bool* copied) {
  *copied = !t.is_contiguous();
  return *copied ? t.contiguous() : t;
}

// For reductions: the dtypes dtrain reduces, bool as uint8, int8 through int32.
Buf reduce_buf(const at::Tensor& t, const char* op, const char* what) {
  check_tensor(t, op, what);
  Buf b;
  b.user = t;
  b.count = static_cast<size_t>(t.numel());
  const at::ScalarType s = t.scalar_type();
  if (s == at::kChar) {
    b.dense = t.to(at::kInt, /*non_blocking=*/false, /*copy=*/true).contiguous();
    b.copied = true;
    b.dtype = comm::DataType::i32;
  } else if (s == at::kBool) {
    b.dense = contiguous_or_copy(t, &b.copied);
    b.dtype = comm::DataType::u8;
  } else if (const auto d = dtrain_dtype(s)) {
    b.dense = contiguous_or_copy(t, &b.copied);
    b.dtype = *d;
  } else {
    TORCH_CHECK_TYPE(false, "dtrain ", op, ": ", what, " has dtype ", s,
                     ", which the dtrain backend cannot reduce (supported: float32, float64, float16, bfloat16, int8, "
                     "int32, int64, uint8, bool)");
  }
  return b;
}

// For data movement: any dtype; those dtrain does not know travel as bytes.
Buf move_buf(const at::Tensor& t, const char* op, const char* what) {
  check_tensor(t, op, what);
  Buf b;
  b.user = t;
  b.dense = contiguous_or_copy(t, &b.copied);
  if (const auto d = dtrain_dtype(t.scalar_type())) {
    b.dtype = *d;
    b.count = static_cast<size_t>(t.numel());
  } else {
    b.dtype = comm::DataType::u8;
    b.count = static_cast<size_t>(t.numel()) * t.element_size();
  }
  return b;
}

void check_one(const std::vector<at::Tensor>& tensors, const char* op, const char* what) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "dtrain ", op, ": expected 1 ", what, " tensor per process, got ",
                    tensors.size());
}

void check_root(int64_t root, int size, const char* op) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "dtrain ", op, ": root rank ", root, " is not in the group of ", size);
}

void check_peer(int peer, int rank, int size, const char* op) {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size, "dtrain ", op, ": peer rank ", peer, " is not in the group of ", size);
  TORCH_CHECK_VALUE(peer != rank, "dtrain ", op, ": rank ", rank, " cannot ", op, " to itself");
}

void check_same(const at::Tensor& t, const at::Tensor& like, const char* op, const char* what, size_t i) {
  check_tensor(t, op, what);
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), "dtrain ", op, ": ", what, " ", i, " has dtype ",
                   t.scalar_type(), ", expected ", like.scalar_type(), " (the input's)");
  TORCH_CHECK_VALUE(t.numel() == like.numel(), "dtrain ", op, ": ", what, " ", i, " has ", t.numel(),
                    " elements, expected ", like.numel(), " (the input's)");
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  const auto* a1 = a0 + a.nbytes();
  const auto* b1 = b0 + b.nbytes();
  return a0 < b1 && b0 < a1;
}

// The tensors of a list, flattened into one contiguous tensor of `like`'s dtrain dtype.
at::Tensor pack(const std::vector<at::Tensor>& tensors, const at::Tensor& like) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}).to(like.scalar_type()));
  return at::cat(flat);
}

// Copies block i (numel of outputs[i]) of `flat` into each output tensor.
void unpack(const at::Tensor& flat, const std::vector<at::Tensor>& outputs) {
  int64_t offset = 0;
  for (const auto& out : outputs) {
    out.copy_(flat.narrow(0, offset, out.numel()).view(out.sizes()));
    offset += out.numel();
  }
}

// The one call of dtrain's compressed all_reduce (comm/compressed.h).
comm::Work start_compressed_all_reduce(comm::Group& g, float* data, size_t count, comm::Codec codec, comm::ReduceOp op,
                                       float* residual) {
  return comm::all_reduce_compressed_async(g, data, data, count, codec, op, residual, nullptr);
}

}  // namespace

// An operation as issue() takes it. With both forms it is deferred (work.h), so both must
// capture what they use by value.
struct ProcessGroupDtrain::Op {
  OpType type = OpType::UNKNOWN;
  bool collective = true;
  std::chrono::milliseconds timeout{0};
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> keep;
  std::function<comm::Work()> start;  // the asynchronous form, where dtrain has one
  std::function<void()> run;          // the blocking form, run in the calling thread
  std::function<void()> epilogue;
};

ProcessGroupDtrain::ProcessGroupDtrain(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                       const BackendOptions& options)
    : c10d::ProcessGroup(rank, size),
      timeout_(options.timeout),
      completer_(std::make_shared<Completer>()),
      ordering_(std::make_shared<Ordering>()) {
  TORCH_CHECK_VALUE(options.timeout.count() > 0, "dtrain: the process group's timeout must be positive, got ",
                    options.timeout.count(), " ms");
  auto dstore = wrap_c10d_store(store);
  comm::GroupOptions go;
  go.timeout = std::chrono::duration_cast<comm::Duration>(options.timeout);
  go.bind_address = bind_address(store);
  const char* secret = std::getenv("DTRAIN_SECRET");
  if (secret == nullptr || *secret == '\0') {
    // No job secret (torchrun, init_method tcp:// or file://): rank 0 makes one for the TCP
    // transport and the group reads it from torch's store, which is then what protects it.
    if (rank == 0) dstore->set("dtrain/secret", comm::make_secret());
    go.secret = dstore->get("dtrain/secret", go.timeout);
  }
  group_ = comm::Group::create(dstore, rank, size, go, options.name.empty() ? "world" : options.name);
  if (const char* defer = std::getenv("DTRAIN_TORCH_DEFER"); defer != nullptr && std::string(defer) == "0") {
    defer_ = false;
  }
  if (options.name.empty() || options.name == "world") {
    if (auto plan = FaultPlan::from_env(rank); !plan.empty()) faults_ = std::make_shared<const FaultPlan>(plan);
  }
  ordering_->enroll();
  init();
}

ProcessGroupDtrain::~ProcessGroupDtrain() {
  {
    std::lock_guard<std::mutex> lock(ordering_->mu);
    ordering_->close();  // starts the deferred collective; nothing is deferred after
  }
  completer_.reset();      // completes the futures asked for (the group still runs their operations)
  group_ = comm::Group();  // stops its progress thread: no operation touches the works' tensors after it
  std::lock_guard<std::mutex> lock(ordering_->mu);
  ordering_->forget_inflight();
}

std::chrono::milliseconds ProcessGroupDtrain::call_timeout(std::chrono::milliseconds requested) const {
  return requested > std::chrono::milliseconds::zero() ? requested : timeout_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::issue(Op&& op) {
  const auto timeout = op.timeout > std::chrono::milliseconds::zero() ? op.timeout : timeout_;
  auto work = c10::make_intrusive<PendingWork>(rank_, op.type, timeout, completer_);
  work->outputs = std::move(op.outputs);
  work->keep = std::move(op.keep);
  work->epilogue = std::move(op.epilogue);
  if (op.collective) {
    const uint64_t n = collectives_.fetch_add(1, std::memory_order_relaxed) + 1;
    if (faults_) faults_->at_collective(n);
  }
  std::lock_guard<std::mutex> lock(ordering_->mu);
  ordering_->flush();
  ordering_->flush_others();  // a collective deferred on another group goes first: it was issued first
  if (op.start && op.run && defer_) {
    work->start = std::move(op.start);
    work->run = std::move(op.run);
    ordering_->defer(work);
  } else if (op.start) {
    ordering_->start(work, std::move(op.start));
  } else {
    std::exception_ptr error;
    try {
      op.run();
    } catch (...) {
      error = std::current_exception();
    }
    work->finish_inline(error);
  }
  return work;
}

// ---------------------------------------------------------------------------------- collectives

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  check_one(tensors, "broadcast", "");
  check_root(opts.rootRank, size_, "broadcast");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "dtrain broadcast: rootTensor must be 0, got ", opts.rootTensor);
  const Buf b = move_buf(tensors[0], "broadcast", "tensor");
  const int root = static_cast<int>(opts.rootRank);
  Op op;
  op.type = OpType::BROADCAST;
  op.timeout = call_timeout(opts.timeout);
  op.outputs = tensors;
  op.keep = {b.dense};
  op.start = [this, b, root] { return group_.broadcast_async(b.data(), b.count, b.dtype, root); };
  op.run = [this, b, root] { group_.broadcast(b.data(), b.count, b.dtype, root); };
  if (b.copied && rank_ != root) op.epilogue = [b] { b.copy_back(); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  check_one(tensors, "all_reduce", "");
  const Buf b = reduce_buf(tensors[0], "all_reduce", "tensor");
  const comm::ReduceOp rop = reduce_op(opts.reduceOp, tensors[0].scalar_type(), "all_reduce");
  Op op;
  op.type = OpType::ALLREDUCE;
  op.timeout = call_timeout(opts.timeout);
  op.outputs = tensors;
  op.keep = {b.dense};
  op.start = [this, b, rop] { return group_.all_reduce_async(b.data(), b.data(), b.count, b.dtype, rop); };
  op.run = [this, b, rop] { group_.all_reduce(b.data(), b.data(), b.count, b.dtype, rop); };
  if (b.copied) op.epilogue = [b] { b.copy_back(); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                       const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK_VALUE(!tensors.empty(), "dtrain all_reduce_coalesced: no tensors");
  for (const auto i : c10::irange(tensors.size())) {
    reduce_buf(tensors[i], "all_reduce_coalesced", "tensor");
    TORCH_CHECK_TYPE(tensors[i].scalar_type() == tensors[0].scalar_type(), "dtrain all_reduce_coalesced: tensor ", i,
                     " has dtype ", tensors[i].scalar_type(), ", tensor 0 ", tensors[0].scalar_type());
  }
  const comm::ReduceOp rop = reduce_op(opts.reduceOp, tensors[0].scalar_type(), "all_reduce_coalesced");
  const Buf b = reduce_buf(pack(tensors, tensors[0]), "all_reduce_coalesced", "tensor");
  Op op;
  op.type = OpType::ALLREDUCE_COALESCED;
  op.timeout = call_timeout(opts.timeout);
  op.outputs = tensors;
  op.keep = {b.dense};
  op.start = [this, b, rop] { return group_.all_reduce_async(b.data(), b.data(), b.count, b.dtype, rop); };
  op.run = [this, b, rop] { group_.all_reduce(b.data(), b.data(), b.count, b.dtype, rop); };
  op.epilogue = [b, tensors] { unpack(b.dense, tensors); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  check_one(tensors, "reduce", "");
  check_root(opts.rootRank, size_, "reduce");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "dtrain reduce: rootTensor must be 0, got ", opts.rootTensor);
  const Buf b = reduce_buf(tensors[0], "reduce", "tensor");
  const comm::ReduceOp rop = reduce_op(opts.reduceOp, tensors[0].scalar_type(), "reduce");
  const int root = static_cast<int>(opts.rootRank);
  Op op;
  op.type = OpType::REDUCE;
  op.outputs = tensors;
  op.run = [&] {
    // Only the root's tensor receives the result; the others' stay as they were.
    const at::Tensor recv = rank_ == root ? b.dense : at::empty_like(b.dense);
    group_.reduce(b.data(), recv.data_ptr(), b.count, b.dtype, rop, root);
  };
  if (b.copied && rank_ == root) op.epilogue = [b] { b.copy_back(); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  check_one(inputs, "all_gather", "input");
  TORCH_CHECK_VALUE(outputs.size() == 1, "dtrain all_gather: expected 1 list of output tensors, got ", outputs.size());
  const std::vector<at::Tensor>& outs = outputs[0];
  TORCH_CHECK_VALUE(outs.size() == static_cast<size_t>(size_), "dtrain all_gather: ", outs.size(),
                    " output tensors for a group of ", size_);
  const Buf in = move_buf(inputs[0], "all_gather", "input");
  for (const auto i : c10::irange(outs.size())) check_same(outs[i], inputs[0], "all_gather", "output", i);
  const at::Tensor flat = at::empty({static_cast<int64_t>(size_) * inputs[0].numel()}, in.dense.options());
  Op op;
  op.type = OpType::ALLGATHER;
  op.timeout = call_timeout(opts.timeout);
  op.outputs = outs;
  op.keep = {in.dense, flat};
  op.start = [this, in, flat] { return group_.all_gather_async(in.data(), flat.data_ptr(), in.count, in.dtype); };
  op.run = [this, in, flat] { group_.all_gather(in.data(), flat.data_ptr(), in.count, in.dtype); };
  op.epilogue = [flat, outs] { unpack(flat, outs); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  Buf in = move_buf(input, "_allgather_base", "input");
  check_tensor(output, "_allgather_base", "output");
  TORCH_CHECK_TYPE(output.scalar_type() == input.scalar_type(), "dtrain _allgather_base: output has dtype ",
                   output.scalar_type(), ", input ", input.scalar_type());
  TORCH_CHECK_VALUE(output.numel() == size_ * input.numel(), "dtrain _allgather_base: output has ", output.numel(),
                    " elements, expected ", size_, " x ", input.numel(), " (the group's size times the input's)");
  Buf out = move_buf(output, "_allgather_base", "output");
  if (overlaps(in.dense, out.dense)) in.dense = in.dense.clone();  // in place: the input is a block of the output
  Op op;
  op.type = OpType::_ALLGATHER_BASE;
  op.timeout = call_timeout(opts.timeout);
  op.outputs = {output};
  op.keep = {in.dense, out.dense};
  op.start = [this, in, out] { return group_.all_gather_async(in.data(), out.data(), in.count, in.dtype); };
  op.run = [this, in, out] { group_.all_gather(in.data(), out.data(), in.count, in.dtype); };
  if (out.copied) op.epilogue = [out] { out.copy_back(); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                       std::vector<at::Tensor>& inputs,
                                                                       const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "dtrain all_gather_coalesced: ", outputs.size(),
                    " output lists for ", inputs.size(), " inputs");
  // One all_gather per input, in order: every rank issues the same sequence.
  c10::intrusive_ptr<c10d::Work> last;
  for (const auto i : c10::irange(inputs.size())) {
    std::vector<std::vector<at::Tensor>> out{outputs[i]};
    std::vector<at::Tensor> in{inputs[i]};
    last = allgather(out, in, opts);
    if (i + 1 < inputs.size()) last->wait();
  }
  TORCH_CHECK_VALUE(last, "dtrain all_gather_coalesced: no inputs");
  return last;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::GatherOptions& opts) {
  check_one(inputs, "gather", "input");
  check_root(opts.rootRank, size_, "gather");
  const int root = static_cast<int>(opts.rootRank);
  const Buf in = move_buf(inputs[0], "gather", "input");
  std::vector<at::Tensor> outs;
  at::Tensor flat;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(size_),
                      "dtrain gather: the root needs a list of ", size_, " output tensors");
    outs = outputs[0];
    for (const auto i : c10::irange(outs.size())) check_same(outs[i], inputs[0], "gather", "output", i);
    flat = at::empty({static_cast<int64_t>(size_) * inputs[0].numel()}, in.dense.options());
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                      "dtrain gather: output tensors are only for the root (rank ", root, ")");
  }
  Op op;
  op.type = OpType::GATHER;
  op.outputs = outs;
  op.run = [&] { group_.gather(in.data(), flat.defined() ? flat.data_ptr() : nullptr, in.count, in.dtype, root); };
  if (rank_ == root) op.epilogue = [flat, outs] { unpack(flat, outs); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ScatterOptions& opts) {
  check_one(outputs, "scatter", "output");
  check_root(opts.rootRank, size_, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  const Buf out = move_buf(outputs[0], "scatter", "output");
  at::Tensor flat;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_),
                      "dtrain scatter: the root needs a list of ", size_, " input tensors");
    for (const auto i : c10::irange(inputs[0].size())) check_same(inputs[0][i], outputs[0], "scatter", "input", i);
    flat = pack(inputs[0], outputs[0]);
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                      "dtrain scatter: input tensors are only for the root (rank ", root, ")");
  }
  Op op;
  op.type = OpType::SCATTER;
  op.outputs = outputs;
  op.run = [&] { group_.scatter(flat.defined() ? flat.data_ptr() : nullptr, out.data(), out.count, out.dtype, root); };
  if (out.copied) op.epilogue = [out] { out.copy_back(); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  check_one(outputs, "reduce_scatter", "output");
  TORCH_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_),
                    "dtrain reduce_scatter: expected a list of ", size_, " input tensors");
  const std::vector<at::Tensor>& ins = inputs[0];
  const Buf out = reduce_buf(outputs[0], "reduce_scatter", "output");
  const comm::ReduceOp rop = reduce_op(opts.reduceOp, outputs[0].scalar_type(), "reduce_scatter");
  std::vector<size_t> counts;
  bool even = true;
  for (const auto i : c10::irange(ins.size())) {
    check_tensor(ins[i], "reduce_scatter", "input");
    TORCH_CHECK_TYPE(ins[i].scalar_type() == outputs[0].scalar_type(), "dtrain reduce_scatter: input ", i,
                     " has dtype ", ins[i].scalar_type(), ", the output ", outputs[0].scalar_type());
    counts.push_back(static_cast<size_t>(ins[i].numel()));
    even = even && ins[i].numel() == outputs[0].numel();
  }
  TORCH_CHECK_VALUE(ins[static_cast<size_t>(rank_)].numel() == outputs[0].numel(), "dtrain reduce_scatter: input ",
                    rank_, " has ", ins[static_cast<size_t>(rank_)].numel(), " elements, but this rank's output ",
                    outputs[0].numel());
  const at::Tensor flat = pack(ins, out.dense);
  Op op;
  op.type = OpType::REDUCE_SCATTER;
  op.timeout = call_timeout(opts.timeout);
  op.outputs = outputs;
  op.keep = {flat, out.dense};
  if (even) {
    op.start = [this, flat, out, rop] {
      return group_.reduce_scatter_async(flat.data_ptr(), out.data(), out.count, out.dtype, rop);
    };
    op.run = [this, flat, out, rop] { group_.reduce_scatter(flat.data_ptr(), out.data(), out.count, out.dtype, rop); };
  } else {
    op.run = [&] { group_.reduce_scatter_v(flat.data_ptr(), out.data(), counts, out.dtype, rop); };
  }
  if (out.copied) op.epilogue = [out] { out.copy_back(); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  Buf in = reduce_buf(input, "_reduce_scatter_base", "input");
  const Buf out = reduce_buf(output, "_reduce_scatter_base", "output");
  TORCH_CHECK_TYPE(output.scalar_type() == input.scalar_type(), "dtrain _reduce_scatter_base: output has dtype ",
                   output.scalar_type(), ", input ", input.scalar_type());
  TORCH_CHECK_VALUE(input.numel() == size_ * output.numel(), "dtrain _reduce_scatter_base: input has ", input.numel(),
                    " elements, expected ", size_, " x ", output.numel(), " (the group's size times the output's)");
  const comm::ReduceOp rop = reduce_op(opts.reduceOp, output.scalar_type(), "_reduce_scatter_base");
  if (overlaps(in.dense, out.dense)) in.dense = in.dense.clone();
  Op op;
  op.type = OpType::_REDUCE_SCATTER_BASE;
  op.timeout = call_timeout(opts.timeout);
  op.outputs = {output};
  op.keep = {in.dense, out.dense};
  op.start = [this, in, out, rop] {
    return group_.reduce_scatter_async(in.data(), out.data(), out.count, out.dtype, rop);
  };
  op.run = [this, in, out, rop] { group_.reduce_scatter(in.data(), out.data(), out.count, out.dtype, rop); };
  if (out.copied) op.epilogue = [out] { out.copy_back(); };
  return issue(std::move(op));
}

// ---------------------------------------------------------------------------------- all_to_all

namespace {

// all_to_all of blocks of different sizes as one all_to_all of equal, padded blocks: the
// ranks first agree on the largest block (an all_reduce of one int64), then every block
// travels in a slot of that size. `send_bytes[j]` bytes at send_ptr[j] go to rank j; rank j's
// block lands at recv_ptr[j] (recv_bytes[j] bytes).
void all_to_all_padded(comm::Group& g, const std::vector<const char*>& send_ptr, const std::vector<size_t>& send_bytes,
                       const std::vector<char*>& recv_ptr, const std::vector<size_t>& recv_bytes) {
  const size_t n = send_ptr.size();
  int64_t slot = 0;
  for (size_t j = 0; j < n; ++j) {
    slot = std::max<int64_t>(slot, static_cast<int64_t>(std::max(send_bytes[j], recv_bytes[j])));
  }
  g.all_reduce(&slot, &slot, 1, comm::DataType::i64, comm::ReduceOp::max);
  const auto s = static_cast<size_t>(slot);
  std::vector<char> send(n * s), recv(n * s);
  for (size_t j = 0; j < n; ++j) {
    if (send_bytes[j] > 0) std::memcpy(send.data() + j * s, send_ptr[j], send_bytes[j]);
  }
  g.all_to_all(send.data(), recv.data(), s, comm::DataType::u8);
  for (size_t j = 0; j < n; ++j) {
    if (recv_bytes[j] > 0) std::memcpy(recv_ptr[j], recv.data() + j * s, recv_bytes[j]);
  }
}

std::vector<int64_t> splits_or_even(const std::vector<int64_t>& splits, const at::Tensor& t, int size,
                                    const char* what) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % size == 0, "dtrain all_to_all_single: the ", what, "'s first dimension (", rows,
                      ") does not split evenly over ", size, " ranks; pass ", what, "_split_sizes");
    return std::vector<int64_t>(static_cast<size_t>(size), rows / size);
  }
  TORCH_CHECK_VALUE(splits.size() == static_cast<size_t>(size), "dtrain all_to_all_single: ", splits.size(), " ", what,
                    " split sizes for a group of ", size);
  int64_t total = 0;
  for (const int64_t v : splits) {
    TORCH_CHECK_VALUE(v >= 0, "dtrain all_to_all_single: negative ", what, " split size ", v);
    total += v;
  }
  TORCH_CHECK_VALUE(total == rows, "dtrain all_to_all_single: the ", what, " split sizes add up to ", total,
                    ", but its first dimension is ", rows);
  return splits;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                 std::vector<int64_t>& output_split_sizes,
                                                                 std::vector<int64_t>& input_split_sizes,
                                                                 const c10d::AllToAllOptions& /*opts*/) {
  Buf in = move_buf(input, "all_to_all_single", "input");
  const Buf out = move_buf(output, "all_to_all_single", "output");
  TORCH_CHECK_TYPE(output.scalar_type() == input.scalar_type(), "dtrain all_to_all_single: output has dtype ",
                   output.scalar_type(), ", input ", input.scalar_type());
  if (overlaps(in.dense, out.dense)) in.dense = in.dense.clone();
  Op op;
  op.type = OpType::ALLTOALL_BASE;
  op.outputs = {output};
  if (output_split_sizes.empty() && input_split_sizes.empty()) {
    TORCH_CHECK_VALUE(input.numel() % size_ == 0 && output.numel() == input.numel(),
                      "dtrain all_to_all_single: input (", input.numel(), " elements) and output (", output.numel(),
                      ") must have the same size, a multiple of the group's ", size_);
    op.run = [&] { group_.all_to_all(in.data(), out.data(), in.count / static_cast<size_t>(size_), in.dtype); };
  } else {
    const auto send_rows = splits_or_even(input_split_sizes, input, size_, "input");
    const auto recv_rows = splits_or_even(output_split_sizes, output, size_, "output");
    const int64_t in_rows = input.dim() == 0 ? 1 : input.size(0), out_rows = output.dim() == 0 ? 1 : output.size(0);
    const size_t in_row_bytes = in_rows == 0 ? 0 : in.dense.nbytes() / static_cast<size_t>(in_rows);
    const size_t out_row_bytes = out_rows == 0 ? 0 : out.dense.nbytes() / static_cast<size_t>(out_rows);
    TORCH_CHECK_VALUE(in_rows == 0 || out_rows == 0 || in_row_bytes == out_row_bytes,
                      "dtrain all_to_all_single: input and output rows differ in size (", in_row_bytes, " vs ",
                      out_row_bytes, " bytes)");
    op.run = [&, send_rows, recv_rows, in_row_bytes, out_row_bytes] {
      std::vector<const char*> sp;
      std::vector<char*> rp;
      std::vector<size_t> sb, rb;
      size_t so = 0, ro = 0;
      for (const auto j : c10::irange(static_cast<size_t>(size_))) {
        sp.push_back(static_cast<const char*>(in.data()) + so);
        sb.push_back(static_cast<size_t>(send_rows[j]) * in_row_bytes);
        so += sb.back();
        rp.push_back(static_cast<char*>(out.data()) + ro);
        rb.push_back(static_cast<size_t>(recv_rows[j]) * out_row_bytes);
        ro += rb.back();
      }
      all_to_all_padded(group_, sp, sb, rp, rb);
    };
  }
  if (out.copied) op.epilogue = [out] { out.copy_back(); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions& /*opts*/) {
  TORCH_CHECK_VALUE(inputs.size() == static_cast<size_t>(size_) && outputs.size() == static_cast<size_t>(size_),
                    "dtrain all_to_all: expected ", size_, " input and output tensors, got ", inputs.size(), " and ",
                    outputs.size());
  std::vector<Buf> ins, outs;
  for (const auto j : c10::irange(inputs.size())) {
    ins.push_back(move_buf(inputs[j], "all_to_all", "input"));
    outs.push_back(move_buf(outputs[j], "all_to_all", "output"));
    TORCH_CHECK_TYPE(
        inputs[j].scalar_type() == inputs[0].scalar_type() && outputs[j].scalar_type() == inputs[0].scalar_type(),
        "dtrain all_to_all: every input and output tensor must have dtype ", inputs[0].scalar_type());
  }
  Op op;
  op.type = OpType::ALLTOALL;
  op.outputs = outputs;
  op.run = [&] {
    std::vector<const char*> sp;
    std::vector<char*> rp;
    std::vector<size_t> sb, rb;
    for (const auto j : c10::irange(ins.size())) {
      sp.push_back(static_cast<const char*>(ins[j].data()));
      sb.push_back(ins[j].dense.nbytes());
      rp.push_back(static_cast<char*>(outs[j].data()));
      rb.push_back(outs[j].dense.nbytes());
    }
    all_to_all_padded(group_, sp, sb, rp, rb);
  };
  op.epilogue = [outs] {
    for (const auto& o : outs) o.copy_back();
  };
  return issue(std::move(op));
}

// ---------------------------------------------------------------------------------- point to point

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  check_one(tensors, "send", "");
  check_peer(dst, rank_, size_, "send");
  TORCH_CHECK_VALUE(tag >= 0, "dtrain send: tag must be non-negative, got ", tag);
  const Buf b = move_buf(tensors[0], "send", "tensor");
  Op op;
  op.type = OpType::SEND;
  op.collective = false;
  op.keep = {b.dense};
  op.start = [&] { return group_.send_async(b.data(), b.count, b.dtype, dst, static_cast<uint32_t>(tag)); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  check_one(tensors, "recv", "");
  check_peer(src, rank_, size_, "recv");
  TORCH_CHECK_VALUE(tag >= 0, "dtrain recv: tag must be non-negative, got ", tag);
  const Buf b = move_buf(tensors[0], "recv", "tensor");
  Op op;
  op.type = OpType::RECV;
  op.collective = false;
  op.outputs = tensors;
  op.keep = {b.dense};
  op.start = [&] { return group_.recv_async(b.data(), b.count, b.dtype, src, static_cast<uint32_t>(tag)); };
  if (b.copied) op.epilogue = [b] { b.copy_back(); };
  return issue(std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::recvAnysource(std::vector<at::Tensor>& /*tensors*/, int /*tag*/) {
  TORCH_CHECK_VALUE(false, "dtrain recv: a receive from any source is not supported; pass src");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::barrier(const c10d::BarrierOptions& /*opts*/) {
  Op op;
  op.type = OpType::BARRIER;
  op.run = [&] { group_.barrier(); };
  return issue(std::move(op));
}

// ---------------------------------------------------------------------------------- compressed

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::allreduce_compressed(at::Tensor& tensor, comm::Codec codec,
                                                                        comm::ReduceOp rop,
                                                                        const at::Tensor& residual) {
  check_tensor(tensor, "all_reduce_compressed", "tensor");
  TORCH_CHECK_TYPE(tensor.scalar_type() == at::kFloat, "dtrain all_reduce_compressed: tensor has dtype ",
                   tensor.scalar_type(), "; the compressed all_reduce is for float32");
  TORCH_CHECK_VALUE(rop == comm::ReduceOp::sum || rop == comm::ReduceOp::avg,
                    "dtrain all_reduce_compressed: only sum and avg");
  bool copied = false;
  const at::Tensor dense = contiguous_or_copy(tensor, &copied);
  float* res = nullptr;
  if (residual.defined()) {
    check_tensor(residual, "all_reduce_compressed", "residual");
    TORCH_CHECK_VALUE(
        residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.numel() == tensor.numel(),
        "dtrain all_reduce_compressed: the residual must be a contiguous float32 tensor of ", tensor.numel(),
        " elements");
    TORCH_CHECK_VALUE(!overlaps(residual, dense), "dtrain all_reduce_compressed: the residual overlaps the tensor");
    res = residual.data_ptr<float>();
  }
  Op op;
  op.type = OpType::ALLREDUCE;
  op.outputs = {tensor};
  op.keep = {dense};
  if (residual.defined()) op.keep.push_back(residual);
  op.start = [&] {
    return start_compressed_all_reduce(group_, dense.data_ptr<float>(), static_cast<size_t>(dense.numel()), codec, rop,
                                       res);
  };
  if (copied) op.epilogue = [tensor, dense]() mutable { tensor.copy_(dense); };
  return issue(std::move(op));
}

c10::intrusive_ptr<ProcessGroupDtrain> create_process_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                            int size, std::chrono::milliseconds timeout,
                                                            const std::string& name) {
  BackendOptions options;
  options.timeout = timeout;
  options.name = name;
  return c10::make_intrusive<ProcessGroupDtrain>(store, rank, size, options);
}

}  // namespace dtrain::torch_backend
