# The torch adapter (src/torch, python/dtrain_torch): a torch.distributed backend over
# dtrain_comm. Built when libtorch (libtorch-dev), pybind11 (pybind11-dev) and the headers of
# the Python that has PyTorch (python3-dev; DTRAIN_TORCH_PYTHON) are found, like MPI; without
# them the build says so and goes on. scripts/install-deps installs all three.
#
# Outputs: the static library dtrain_torch (C++: ProcessGroupDtrain, include/dtrain/torch) and
# the Python package <build>/python/dtrain_torch (import it with PYTHONPATH=<build>/python;
# `cmake --install` puts it in DTRAIN_TORCH_INSTALL_DIR, on the default prefix a folder on sys.path).
option(DTRAIN_TORCH "build the torch.distributed backend (dtrain_torch) when libtorch is found" ON)
set(DTRAIN_TORCH_PYTHON /usr/bin/python3 CACHE FILEPATH "the Python with PyTorch that dtrain_torch is built for")

set(dtrain_torch_missing "")
if(DTRAIN_TORCH)
  find_package(Torch QUIET)
  if(NOT Torch_FOUND AND NOT TORCH_FOUND)
    set(dtrain_torch_missing "libtorch (libtorch-dev)")
  else()
    set(Python3_EXECUTABLE ${DTRAIN_TORCH_PYTHON})
    find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
    find_package(pybind11 CONFIG QUIET)
    if(NOT Python3_Development.Module_FOUND)
      set(dtrain_torch_missing "the headers of ${DTRAIN_TORCH_PYTHON} (python3-dev)")
    elseif(NOT pybind11_FOUND)
      set(dtrain_torch_missing "pybind11 (pybind11-dev)")
    endif()
  endif()
else()
  set(dtrain_torch_missing "DTRAIN_TORCH=OFF")
endif()

if(NOT dtrain_torch_missing STREQUAL "")
  message(STATUS "dtrain: building without the torch.distributed backend (missing ${dtrain_torch_missing})")
  return()
endif()
message(STATUS "dtrain: torch.distributed backend dtrain_torch for ${Python3_EXECUTABLE} (libtorch ${Torch_VERSION})")

# libtorch's imported targets carry its include directories, which CMake passes as -isystem:
# their warnings do not trip -Werror.
# DistributedDataParallel (src/torch/ddp.cpp) runs on dtrain_parallel's gradient Reducer; DTRAIN_FAULT
# is read by dtrain_launch's parser (src/torch/fault.cpp).
add_library(dtrain_torch STATIC src/torch/ddp.cpp src/torch/fault.cpp src/torch/process_group.cpp src/torch/store.cpp
                                src/torch/work.cpp)
target_link_libraries(dtrain_torch PUBLIC dtrain_comm dtrain_parallel torch PRIVATE dtrain_launch)
target_compile_options(dtrain_torch PRIVATE -O2)
set(DTRAIN_HEADER_CHECK_ONLY "dtrain/torch/*")
dtrain_header_check(dtrain_torch_header_check "" dtrain_torch)
unset(DTRAIN_HEADER_CHECK_ONLY)

set(DTRAIN_TORCH_PACKAGE_DIR ${PROJECT_BINARY_DIR}/python/dtrain_torch)
pybind11_add_module(dtrain_torch_python MODULE NO_EXTRAS python/dtrain_torch/module.cpp)
# torch_python holds the Python type casters of tensors; its headers are under TORCH_INCLUDE_DIRS.
find_library(DTRAIN_TORCH_PYTHON_LIBRARY torch_python HINTS ${TORCH_INSTALL_PREFIX}/lib)
target_link_libraries(dtrain_torch_python PRIVATE dtrain_torch ${DTRAIN_TORCH_PYTHON_LIBRARY})
set_target_properties(dtrain_torch_python PROPERTIES OUTPUT_NAME _C
  LIBRARY_OUTPUT_DIRECTORY ${DTRAIN_TORCH_PACKAGE_DIR})

# The package's Python files next to the module.
file(GLOB DTRAIN_TORCH_PY CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/python/dtrain_torch/*.py)
set(dtrain_torch_py_out "")
foreach(py ${DTRAIN_TORCH_PY})
  get_filename_component(name ${py} NAME)
  add_custom_command(OUTPUT ${DTRAIN_TORCH_PACKAGE_DIR}/${name} COMMAND ${CMAKE_COMMAND} -E copy ${py}
                     ${DTRAIN_TORCH_PACKAGE_DIR}/${name} DEPENDS ${py})
  list(APPEND dtrain_torch_py_out ${DTRAIN_TORCH_PACKAGE_DIR}/${name})
endforeach()
add_custom_target(dtrain_torch_package ALL DEPENDS ${dtrain_torch_py_out} dtrain_torch_python)

# A path under the install prefix that Debian's Python searches (/usr/local/lib/python3.X/dist-packages).
set(DTRAIN_TORCH_INSTALL_DIR lib/python${Python3_VERSION_MAJOR}.${Python3_VERSION_MINOR}/dist-packages
    CACHE PATH "where cmake --install puts the dtrain_torch package (relative: under CMAKE_INSTALL_PREFIX)")
install(TARGETS dtrain_torch_python LIBRARY DESTINATION ${DTRAIN_TORCH_INSTALL_DIR}/dtrain_torch)
install(FILES ${DTRAIN_TORCH_PY} DESTINATION ${DTRAIN_TORCH_INSTALL_DIR}/dtrain_torch)

# Tests of DistributedDataParallel for libtorch: ranks as threads (GoogleTest).
if(DTRAIN_BUILD_TESTS)
  find_package(GTest REQUIRED)
  include(GoogleTest)
  add_executable(dtrain_torch_tests tests/torch/libtorch_ddp_test.cpp)
  target_include_directories(dtrain_torch_tests PRIVATE tests)
  target_link_libraries(dtrain_torch_tests PRIVATE dtrain_torch GTest::gtest GTest::gtest_main Threads::Threads)
  gtest_discover_tests(dtrain_torch_tests DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 300 ENVIRONMENT OMP_NUM_THREADS=1)
endif()

# Tests: PyTorch programs against gloo (tests/torch), each a CTest test run by the same Python,
# which must have PyTorch (python3-torch, python3-torchvision).
execute_process(COMMAND ${Python3_EXECUTABLE} -c "import torch, torchvision" RESULT_VARIABLE dtrain_torch_import
                OUTPUT_QUIET ERROR_QUIET)
if(DTRAIN_BUILD_TESTS AND NOT dtrain_torch_import EQUAL 0)
  message(STATUS "dtrain: ${Python3_EXECUTABLE} cannot import torch and torchvision: the tests in tests/torch are left out")
elseif(DTRAIN_BUILD_TESTS)
  file(GLOB DTRAIN_TORCH_TESTS CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/torch/test_*.py)
  foreach(test ${DTRAIN_TORCH_TESTS})
    get_filename_component(name ${test} NAME_WE)
    string(REGEX REPLACE "^test_" "" name ${name})
    add_test(NAME torch_${name} COMMAND ${Python3_EXECUTABLE} ${test})
    # 77: a test that cannot run here says so (test_hosts without root).
    set_tests_properties(torch_${name} PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77
      ENVIRONMENT "PYTHONPATH=${PROJECT_BINARY_DIR}/python;DTRAIN_BINARY=$<TARGET_FILE:dtrain>;OMP_NUM_THREADS=1")
  endforeach()
endif()
