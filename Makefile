# The two commands of the README: `make train` and `make test`. Both install what is missing first.
BUILD ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)

.PHONY: setup configure build train test clean

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

clean:
	rm -rf $(BUILD)
