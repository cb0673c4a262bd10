# The two commands of the README: `make train` and `make test`. Both install what is missing first.
BUILD ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
# ccache keys on paths relative to the checkout, so every clone and build directory shares one cache.
export CCACHE_BASEDIR := $(CURDIR)
# Builds with debug info (the sanitizer and fuzz builds: -g1) would also key on the build directory's
# absolute path (ccache's hash_dir), so a clean clone elsewhere missed every entry: not hashed.
export CCACHE_NOHASHDIR := 1

.PHONY: setup configure build train test sanitize fuzz clean

setup:
	@bash scripts/setup

configure: setup
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) > /dev/null

build: configure
	@ninja -C $(BUILD) -j $(JOBS)

# The default training job: the MLP on Fashion-MNIST.
train: build
	./$(BUILD)/shardstep train --config configs/mlp.toml --metrics-out $(BUILD)/train_metrics.jsonl --plot-out $(BUILD)/train.svg

# Every test: fast ones first, then the ones labelled slow.
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -L fast
	cd $(BUILD) && ctest --output-on-failure -j 1 -L slow

# Sanitizer builds of the suite (ASan+UBSan of every test, TSan of the runtime, collectives and
# executor tests), each in its own build directory.
sanitize: setup
	@bash scripts/sanitize

# libFuzzer targets (clang-14), each run for FUZZ_SECONDS on its corpus.
FUZZ_SECONDS ?= 60
fuzz: setup
	@bash scripts/fuzz $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD)
