// The transport kinds' names (transport.h).
#include "dtrain/comm/transport.h"

namespace dtrain::comm {

const char* name_of(TransportKind kind) {
  switch (kind) {
    case TransportKind::automatic:
      return "auto";
    case TransportKind::shm:
      return "shm";
    case TransportKind::tcp:
      return "tcp";
    case TransportKind::mpi:
      return "mpi";
    case TransportKind::none:
      return "none";
  }
  return "?";
}

TransportKind parse_transport(const std::string& text) {
  for (TransportKind k : {TransportKind::automatic, TransportKind::shm, TransportKind::tcp, TransportKind::mpi}) {
    if (text == name_of(k)) return k;
  }
  DT_THROW("comm", "transport '{}': expected auto, shm, tcp or mpi", text);
}

}  // namespace dtrain::comm
