// The MPI backend (Open MPI, MPICH): for clusters that start jobs with mpirun or srun. Built
// when CMake finds MPI; otherwise mpi_built() is false and every other call throws
// dtrain::Error saying that dtrain was not built with MPI. Group::from_mpi is the entry point.
#pragma once

#include <memory>
#include <string>

#include "dtrain/comm/transport.h"

namespace dtrain::comm {

class Store;

/// Whether this build has the MPI backend.
bool mpi_built();

/// MPI_COMM_WORLD as this process sees it (initialises MPI with MPI_THREAD_MULTIPLE on first
/// use and finalises it at exit).
struct MpiWorld {
  int rank = 0;
  int size = 1;
  bool one_host = true;  // every rank shares this host's memory
};
MpiWorld mpi_world();

/// Rank 0's `text` on every rank of MPI_COMM_WORLD (collective).
std::string mpi_broadcast_from_root(const std::string& text);

/// When MPI is running in this process: MPI_Abort(MPI_COMM_WORLD, code), which ends every
/// rank of the job (what mpirun users expect after one rank failed). Otherwise nothing.
void mpi_abort_job(int code);

/// The transport of a group whose ranks are all in MPI_COMM_WORLD: a communicator of the
/// members (their world ranks published in `store` under `prefix`), MPI_Isend/MPI_Irecv for
/// messages and MPI's non-blocking collectives as the native ones, polled against the
/// deadline (spinning briefly, then sleeping). A receive whose tag or size differs from the
/// next message fails naming both; abort() reaches the peers on a second communicator. MPI
/// cannot cancel a collective: after a timeout the process should end.
std::unique_ptr<Transport> make_mpi_transport(Store& store, const std::string& prefix, int rank, int size,
                                              Duration timeout);

}  // namespace dtrain::comm
