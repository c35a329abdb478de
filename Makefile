# dtrain: the two entry points of the README, plus helpers. Every target installs what it needs.
PRESET ?= release
BUILD := build/$(PRESET)
JOBS ?= $(shell nproc)

.PHONY: all deps build test test-asan fuzz demo bench clean format format-check lint install examples

all: build

deps:
	@scripts/install-deps

build: deps
	@cmake --preset $(PRESET) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

# Installs the tool, headers, libraries, CMake package and pkg-config files under PREFIX
# (cmake/install.cmake), e.g. make install PREFIX=/opt/dtrain
PREFIX ?= /usr/local
install: build
	@cmake --install $(BUILD) --prefix $(PREFIX)

# examples/ built as an outside project against an install in build/prefix: build/examples/.
examples: build
	@cmake --install $(BUILD) --prefix $(abspath build/prefix) >/dev/null
	@cmake -S examples -B build/examples -G Ninja -DCMAKE_PREFIX_PATH=$(abspath build/prefix) >/dev/null
	@cmake --build build/examples -j $(JOBS)

# The formatting check, every test of the release build, then a bounded libFuzzer run (the CI run).
test: build format-check
	@ctest --preset $(PRESET) -j $(JOBS)
	@$(MAKE) --no-print-directory fuzz

# libFuzzer (clang, AddressSanitizer) on the TCP store's frame decoder and on the checkpoint
# readers (shard files, manifests) for FUZZ_SECONDS each; new inputs go to build/fuzz/corpus-*,
# the seeds stay in fuzz/corpus.
FUZZ_SECONDS ?= 30
FUZZ_TARGETS := store_frame checkpoint
fuzz: deps
	@cmake -S . -B build/fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
	  -DDTRAIN_FUZZ=ON >/dev/null
	@cmake --build build/fuzz -j $(JOBS) --target $(addsuffix _fuzz,$(FUZZ_TARGETS))
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/fuzz/corpus-$$t; \
	  build/fuzz/fuzz/$${t}_fuzz -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    build/fuzz/corpus-$$t fuzz/corpus/$$t >build/fuzz/$$t.log 2>&1 \
	    || { tail -40 build/fuzz/$$t.log; echo "fuzz: $${t}_fuzz FAILED (log: build/fuzz/$$t.log)"; exit 1; }; \
	  grep -E "^Done|executed_units|new_units" build/fuzz/$$t.log | sed "s/^/fuzz: $$t: /"; \
	done

# The same tests under AddressSanitizer + UndefinedBehaviorSanitizer.
test-asan:
	@$(MAKE) --no-print-directory test PRESET=asan

# Train the default job (Fashion-MNIST MLP, 3 epochs) and print its result.
demo: build
	@scripts/demo

bench: build
	@scripts/install-deps --bench
	@bench/run_all.sh

format:
	@clang-format -i $$(git ls-files '*.cpp' '*.h' '*.c')

# Fails when clang-format would change a tracked file (part of `make test`).
format-check: deps
	@scripts/check-format

# clang-tidy (.clang-tidy) over src/ and tools/. GCC-only warning flags in the compile
# commands are not clang-tidy's business, hence -Wno-unknown-warning-option. The torch adapter
# (src/torch, in the compile commands when libtorch was found) is read as C++17: clang 14 cannot
# parse libtorch 1.13's headers as C++20 with libstdc++ 12 (std::vector<c10::IValue> of an
# incomplete type); dtrain's [[unlikely]] is then an extension, not an error.
lint: build
	@run-clang-tidy -p $(BUILD) -j $(JOBS) -quiet -extra-arg=-Wno-unknown-warning-option \
	  $$(git ls-files 'src/*.cpp' 'tools/*.cpp' ':!src/torch/*')
	@if grep -q '/src/torch/' $(BUILD)/compile_commands.json; then \
	  run-clang-tidy -p $(BUILD) -j $(JOBS) -quiet -extra-arg=-Wno-unknown-warning-option \
	    -extra-arg=-std=c++17 -extra-arg=-Wno-c++20-extensions $$(git ls-files 'src/torch/*.cpp'); \
	else echo "lint: src/torch not built (no libtorch): not linted"; fi

clean:
	@rm -rf build
