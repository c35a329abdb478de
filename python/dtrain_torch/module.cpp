// dtrain_torch._C: the process group, the stores and the compressed all_reduce for Python.
// dtrain_torch/__init__.py registers the backend "dtrain" with torch.distributed.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "dtrain/comm/store.h"
#include "dtrain/torch/process_group.h"

namespace py = pybind11;
using dtrain::torch_backend::ProcessGroupDtrain;

namespace {

ProcessGroupDtrain& dtrain_group(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  auto* g = dynamic_cast<ProcessGroupDtrain*>(pg.get());
  TORCH_CHECK_VALUE(g != nullptr, "dtrain: the process group's backend is '", pg->getBackendName(), "', not 'dtrain'");
  return *g;
}

py::list flight_record(ProcessGroupDtrain& pg) {
  py::list out;
  for (const auto& e : pg.group().flight_record()) {
    py::dict d;
    d["seq"] = e.seq;
    d["op"] = e.op;
    d["collective"] = e.collective;
    d["bytes"] = e.bytes;
    d["peer"] = e.peer;
    d["state"] = dtrain::comm::name_of(e.state);
    d["error"] = e.error;
    out.append(d);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dtrain's torch.distributed backend (see dtrain_torch)";
  py::module_::import("torch.distributed");  // registers c10d's Python types (ProcessGroup, Store, Work)

  py::class_<ProcessGroupDtrain, c10d::ProcessGroup, c10::intrusive_ptr<ProcessGroupDtrain>>(m, "ProcessGroupDtrain")
      .def_property_readonly(
          "transport",
          [](ProcessGroupDtrain& pg) { return std::string(dtrain::comm::name_of(pg.group().transport_kind())); },
          "the transport dtrain chose: shm (one host) or tcp")
      .def("flight_record", &flight_record,
           "the group's last operations, oldest first (dicts with seq, op, bytes, peer, state, error)");

  m.def(
      "_create",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
         const std::string& name) {
        return dtrain::torch_backend::create_process_group(store, rank, size, timeout, name);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("name") = "",
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "_connect_store",
      [](const std::string& host, uint16_t port, const std::string& secret, std::chrono::milliseconds timeout) {
        return dtrain::torch_backend::wrap_dtrain_store(dtrain::comm::connect_tcp_store(host, port, secret, timeout),
                                                        timeout);
      },
      "a torch Store over dtrain's authenticated TCP store at host:port", py::arg("host"), py::arg("port"),
      py::arg("secret"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "_allreduce_compressed",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg, at::Tensor tensor, const std::string& codec,
         const std::string& op, c10::optional<at::Tensor> residual) -> c10::intrusive_ptr<c10d::Work> {
        return dtrain_group(pg).allreduce_compressed(tensor, dtrain::comm::parse_codec(codec),
                                                     dtrain::comm::parse_op(op), residual.value_or(at::Tensor()));
      },
      "dtrain's compressed all_reduce of a float32 tensor (codec none|bf16|fp16|int8|int4, op sum|avg), with "
      "error feedback into `residual` when given; returns the Work",
      py::arg("group"), py::arg("tensor"), py::arg("codec"), py::arg("op") = "avg", py::arg("residual") = py::none(),
      py::call_guard<py::gil_scoped_release>());
}
