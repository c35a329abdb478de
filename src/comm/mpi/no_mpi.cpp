// The MPI backend's entry points in a build without MPI (DTRAIN_MPI off, or CMake found no
// MPI): mpi_built() is false and every call that needs MPI throws dtrain::Error saying that
// MPI is not available in this build, and what to do instead.
#include "dtrain/comm/mpi.h"
#include "dtrain/core/error.h"

namespace dtrain::comm {

namespace {

[[noreturn]] void not_available(const char* what) {
  DT_THROW("comm",
           "{}: MPI is not available: dtrain was built without MPI (DTRAIN_MPI=OFF or no MPI found; "
           "scripts/install-deps installs libopenmpi-dev, then rebuild), or use the default backend (dtrain launch)",
           what);
}

}  // namespace

bool mpi_built() { return false; }
MpiWorld mpi_world() { not_available("mpi_world"); }
std::string mpi_broadcast_from_root(const std::string&) { not_available("mpi_broadcast_from_root"); }
void mpi_abort_job(int) {}  // MPI is not running in this process: nothing to abort
std::unique_ptr<Transport> make_mpi_transport(Store&, const std::string&, int, int, Duration) {
  not_available("make_mpi_transport");
}

}  // namespace dtrain::comm
