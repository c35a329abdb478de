# dtrain: the two entry points of the README, plus helpers. Every target installs what it needs.
PRESET ?= release
BUILD := build/$(PRESET)
JOBS ?= $(shell nproc)

.PHONY: all deps build test test-asan demo bench clean format lint

all: build

deps:
	@scripts/install-deps

build: deps
	@cmake --preset $(PRESET) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

# Every test of the release build (the CI run).
test: build
	@ctest --preset $(PRESET) -j $(JOBS)

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
	@clang-format -i $$(git ls-files '*.cpp' '*.h')

lint: build
	@clang-tidy -p $(BUILD) $$(git ls-files 'src/*.cpp' 'tools/*.cpp')

clean:
	@rm -rf build
