// The MPI entry points (comm/mpi.h) match the build: with MPI found (DTRAIN_MPIRUN is defined
// for the tests then) src/comm/mpi/mpi_transport.cpp is linked; without it (DTRAIN_MPI=OFF, or
// no MPI) src/comm/mpi/no_mpi.cpp, whose calls throw saying that MPI is not available.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>

#include "dtrain/comm/mpi.h"
#include "dtrain/comm/store.h"
#include "dtrain/core/error.h"

namespace dc = dtrain::comm;

namespace {

#ifndef DTRAIN_MPIRUN
void expect_not_available(const std::function<void()>& call, const std::string& name) {
  try {
    call();
    ADD_FAILURE() << name << " did not throw in a build without MPI";
  } catch (const dtrain::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(name), std::string::npos) << what;
    EXPECT_NE(what.find("MPI is not available"), std::string::npos) << what;
    EXPECT_NE(what.find("DTRAIN_MPI=OFF"), std::string::npos) << what;
  }
}
#endif

}  // namespace

TEST(CommMpiBuild, EntryPointsMatchTheBuild) {
#ifdef DTRAIN_MPIRUN
  EXPECT_TRUE(dc::mpi_built());
#else
  EXPECT_FALSE(dc::mpi_built());
  expect_not_available([] { dc::mpi_world(); }, "mpi_world");
  expect_not_available([] { dc::mpi_broadcast_from_root("x"); }, "mpi_broadcast_from_root");
  auto store = dc::make_memory_store();
  expect_not_available([&] { dc::make_mpi_transport(*store, "t", 0, 2, std::chrono::seconds(1)); },
                       "make_mpi_transport");
#endif
  // MPI is not running in this process (no mpirun, never initialised): nothing to abort, in
  // either build, and the test goes on.
  dc::mpi_abort_job(3);
  SUCCEED();
}
