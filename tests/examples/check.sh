#!/usr/bin/env bash
# The examples as an outside project builds them (CTest's examples_installed, so `make test`
# and CI): install the build into a temporary prefix, check what is there (the tool, headers,
# position-independent libraries, the CMake package, pkg-config files), configure and build
# examples/ with find_package(dtrain) against that prefix only, build example (a) and (b) again
# through pkg-config, and run every example under the installed `dtrain launch` (and mpirun).
# The libtorch example runs 50 SGD steps on 2 and 4 processes, and on 1 process accumulating
# the same 2 or 4 slices of each global batch: the parameters must agree within 1e-5 relative
# (they are equal bit for bit: the sum over ranks runs in rank order and N is a power of two).
#
#   tests/examples/check.sh BUILD_DIR SOURCE_DIR WITH_TORCH(ON|OFF) PYTHON "MPIRUN..."
set -euo pipefail
build=$(realpath "$1")
src=$(realpath "$2")
with_torch=${3:-OFF}
python=${4:-/usr/bin/python3}
mpirun=${5:-}

tmp=$(mktemp -d /tmp/dtrain-examples.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
step() { echo "== examples: $*"; }
fail() {
  echo "examples: FAILED: $*" >&2
  exit 1
}

step "install into $prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install"; }
for f in bin/dtrain include/dtrain/comm/group.h include/dtrain/parallel/ddp.h lib/libdtrain_comm.a \
  lib/libdtrain_train.a lib/cmake/dtrain/dtrainConfig.cmake lib/cmake/dtrain/dtrainTargets.cmake \
  lib/pkgconfig/dtrain-comm.pc lib/pkgconfig/dtrain.pc; do
  [[ -e $prefix/$f ]] || fail "$f is not installed"
done
if [[ $with_torch == ON ]]; then
  for f in include/dtrain/torch/ddp.h lib/libdtrain_torch.a lib/cmake/dtrain/dtrainTorchTargets.cmake \
    lib/pkgconfig/dtrain-torch.pc; do
    [[ -e $prefix/$f ]] || fail "$f is not installed"
  done
fi
"$prefix/bin/dtrain" --help >/dev/null || fail "the installed dtrain does not run"
# Position-independent: every installed library links whole into a shared object.
for lib in "$prefix"/lib/libdtrain_*.a; do
  c++ -shared -o "$tmp/pic.so" -Wl,--whole-archive "$lib" -Wl,--no-whole-archive 2>"$tmp/pic.log" ||
    { head -5 "$tmp/pic.log"; fail "$(basename "$lib") does not link into a shared object (not PIC?)"; }
done

step "configure and build examples/ against the prefix (find_package(dtrain))"
cmake -S "$src/examples" -B "$tmp/build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON \
  >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; fail "configuring examples/"; }
grep -q "dtrain_DIR:PATH=$prefix/lib/cmake/dtrain" "$tmp/build/CMakeCache.txt" || fail "examples/ did not find the installed package"
cmake --build "$tmp/build" -j 2 >"$tmp/build.log" 2>&1 || { tail -40 "$tmp/build.log"; fail "building examples/"; }

step "build (a) and (b) again through pkg-config"
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
# shellcheck disable=SC2046
c++ -O1 "$src/examples/comm_allreduce.cpp" -o "$tmp/comm_allreduce_pc" $(pkg-config --cflags --libs dtrain-comm) ||
  fail "comm_allreduce through pkg-config dtrain-comm"
# shellcheck disable=SC2046
c++ -O1 -std=c++20 "$src/examples/custom_model.cpp" -o "$tmp/custom_model_pc" $(pkg-config --cflags --libs dtrain) ||
  fail "custom_model through pkg-config dtrain"
if [[ $with_torch == ON ]]; then
  pkg-config --cflags --libs dtrain-torch >/dev/null || fail "pkg-config dtrain-torch"
fi

launch() { "$prefix/bin/dtrain" launch "$@"; }
step "(a) comm_allreduce under dtrain launch -n 3 (CMake and pkg-config builds)"
launch -n 3 -- "$tmp/build/comm_allreduce" 100003
launch -n 2 -- "$tmp/comm_allreduce_pc" 1000
step "(b) custom_model under dtrain launch -n 2"
launch -n 2 -- "$tmp/build/custom_model" --steps 40 | tee "$tmp/custom.log"
grep -q "test accuracy" "$tmp/custom.log" || fail "custom_model printed no accuracy"
launch -n 1 -- "$tmp/custom_model_pc" --steps 2 >/dev/null
if [[ -n $mpirun ]]; then
  step "(a) comm_allreduce under mpirun -np 2"
  $mpirun -np 2 "$tmp/build/comm_allreduce" 1000
fi

if [[ $with_torch == ON ]]; then
  cnn=$tmp/build/torch_cnn
  step "(c) torch_cnn: 50 SGD steps on 2 and 4 processes against 1 process, same global batches"
  # The one-process run takes each global batch in the same N slices (--micro-batches N,
  # accumulated locally), the N-process run one slice per rank: the same math.
  launch -n 1 -- "$cnn" --steps 1 --lr 0 --save "$tmp/init.pt" >/dev/null
  for n in 2 4; do
    launch -n 1 -- "$cnn" --steps 50 --micro-batches "$n" --save "$tmp/one$n.pt" | tail -1
    launch -n "$n" -- "$cnn" --steps 50 --save "$tmp/p$n.pt" | tail -2
    "$python" "$src/tests/examples/compare_params.py" "$tmp/p$n.pt" "$tmp/one$n.pt" --max-rel 1e-5
  done
  "$python" "$src/tests/examples/compare_params.py" "$tmp/one2.pt" "$tmp/init.pt" --min-rel 1e-3
  if [[ -n $mpirun ]]; then
    step "(c) torch_cnn under mpirun -np 2"
    $mpirun -np 2 "$cnn" --steps 50 --save "$tmp/pmpi.pt" | tail -1
    "$python" "$src/tests/examples/compare_params.py" "$tmp/pmpi.pt" "$tmp/one2.pt" --max-rel 1e-5
  fi
fi
step "all passed"
