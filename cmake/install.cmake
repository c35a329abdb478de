# Installing dtrain (`cmake --install build/release --prefix PREFIX`, or `make install PREFIX=...`):
#   bin/dtrain                              the tool
#   include/dtrain/...                      the public headers (torch/ only with the torch adapter)
#   lib/libdtrain_*.a                       the libraries, static and position-independent
#   lib/cmake/dtrain/                       the CMake package: find_package(dtrain CONFIG) gives
#                                           dtrain::comm (collectives alone), dtrain::train (the
#                                           training core: tensors, nn, optim, data, parallel,
#                                           checkpoints, the trainer), the layers between them, and
#                                           with COMPONENTS torch dtrain::torch (the torch adapter)
#   lib/pkgconfig/dtrain-comm.pc, dtrain.pc, dtrain-torch.pc   the same for pkg-config
#   lib/python3.X/dist-packages/dtrain_torch   the torch.distributed backend (cmake/torch.cmake)
# examples/ is built against such a prefix as an outside project (tests/examples/check.sh).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DTRAIN_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/dtrain)
set(DTRAIN_LIBRARIES dtrain_core dtrain_comm dtrain_tensor dtrain_nn dtrain_parallel dtrain_checkpoint dtrain_launch
    dtrain_train dtrain_plan)
foreach(lib ${DTRAIN_LIBRARIES})
  string(REGEX REPLACE "^dtrain_" "" short ${lib})
  set_target_properties(${lib} PROPERTIES EXPORT_NAME ${short})
endforeach()

install(TARGETS ${DTRAIN_LIBRARIES} EXPORT dtrainTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS dtrain RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/dtrain DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} PATTERN torch EXCLUDE)
install(EXPORT dtrainTargets NAMESPACE dtrain:: DESTINATION ${DTRAIN_INSTALL_CMAKEDIR})

# What the installed libraries were built with, for the package's find_dependency calls.
set(DTRAIN_WITH_MPI OFF)
if(MPI_CXX_FOUND)
  set(DTRAIN_WITH_MPI ON)
endif()
if(TARGET OpenMP::OpenMP_CXX)
  set(DTRAIN_WITH_OPENMP ON)
else()
  set(DTRAIN_WITH_OPENMP OFF)
endif()
set(DTRAIN_WITH_TORCH OFF)
if(TARGET dtrain_torch)
  set(DTRAIN_WITH_TORCH ON)
  set_target_properties(dtrain_torch PROPERTIES EXPORT_NAME torch)
  install(TARGETS dtrain_torch EXPORT dtrainTorchTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(DIRECTORY include/dtrain/torch DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dtrain)
  install(EXPORT dtrainTorchTargets NAMESPACE dtrain:: DESTINATION ${DTRAIN_INSTALL_CMAKEDIR})
endif()

configure_package_config_file(cmake/dtrainConfig.cmake.in ${PROJECT_BINARY_DIR}/dtrainConfig.cmake
                              INSTALL_DESTINATION ${DTRAIN_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/dtrainConfig.cmake ${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake
        DESTINATION ${DTRAIN_INSTALL_CMAKEDIR})

# pkg-config: the libraries are static, so Libs carries every library they need. The prefix is
# found from the file's own place, so a tree installed with `--prefix` anywhere works.
string(REGEX REPLACE "[^/]+" ".." DTRAIN_PC_UP "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
set(DTRAIN_PC_COMM_LIBS "-ldtrain_comm -ldtrain_core")
if(MPI_CXX_FOUND)
  list(JOIN MPI_CXX_LIBRARIES " " mpi_libs)
  string(APPEND DTRAIN_PC_COMM_LIBS " ${mpi_libs}")
endif()
string(APPEND DTRAIN_PC_COMM_LIBS " -lrt -pthread")
set(DTRAIN_PC_TRAIN_LIBS "-ldtrain_plan -ldtrain_train -ldtrain_checkpoint -ldtrain_launch -ldtrain_parallel")
string(APPEND DTRAIN_PC_TRAIN_LIBS " -ldtrain_nn -ldtrain_tensor ${OPENBLAS_LIBRARY}")
if(DTRAIN_WITH_OPENMP AND DNNL_LIBRARY)
  string(APPEND DTRAIN_PC_TRAIN_LIBS " ${DNNL_LIBRARY} -fopenmp")
endif()
foreach(pc dtrain-comm dtrain)
  configure_file(cmake/pkgconfig/${pc}.pc.in ${PROJECT_BINARY_DIR}/pkgconfig/${pc}.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/pkgconfig/${pc}.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
endforeach()
if(DTRAIN_WITH_TORCH)
  # libtorch has no pkg-config file: its include folders and libraries as TorchConfig found them.
  set(DTRAIN_PC_TORCH_CFLAGS "")
  foreach(dir ${TORCH_INCLUDE_DIRS})
    if(NOT dir IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES)  # -isystem /usr/include breaks #include_next
      string(APPEND DTRAIN_PC_TORCH_CFLAGS " -isystem ${dir}")
    endif()
  endforeach()
  string(APPEND DTRAIN_PC_TORCH_CFLAGS " ${TORCH_CXX_FLAGS}")
  get_filename_component(torch_libdir ${TORCH_LIBRARY} DIRECTORY)
  set(DTRAIN_PC_TORCH_LIBS "-L${torch_libdir} -ltorch -ltorch_cpu -lc10")
  configure_file(cmake/pkgconfig/dtrain-torch.pc.in ${PROJECT_BINARY_DIR}/pkgconfig/dtrain-torch.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/pkgconfig/dtrain-torch.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
endif()

# CI: install into a temporary prefix, build examples/ against it as an outside project (CMake
# and pkg-config) and run each example (tests/examples/check.sh).
if(DTRAIN_BUILD_TESTS)
  set(examples_mpirun "")
  if(MPI_CXX_FOUND)
    set(examples_mpirun "${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe --bind-to none")
  endif()
  add_test(NAME examples_installed
    COMMAND ${PROJECT_SOURCE_DIR}/tests/examples/check.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR}
            ${DTRAIN_WITH_TORCH} "${DTRAIN_TORCH_PYTHON}" "${examples_mpirun}")
  set_tests_properties(examples_installed PROPERTIES TIMEOUT 900 ENVIRONMENT "OMP_NUM_THREADS=1")
endif()
