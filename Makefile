# Thin wrapper over CMake. `make` builds into build/; `make test` and `make demo` first install the
# Debian packages they need (idempotently, only what is missing) so they work on a fresh machine.

BUILD      ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
FUZZ_BUILD ?= build-fuzz
FUZZ_SECS  ?= 60
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
WERROR     ?= ON

BUILD_PKGS := gcc make cmake pkg-config libjansson-dev libmicrohttpd-dev libcurl4-openssl-dev \
              libhiredis-dev libssl-dev libfabric-dev
TEST_PKGS  := $(BUILD_PKGS) libcriterion-dev redis-server etcd-server python3-pytest python3-numpy \
              clang
DEMO_PKGS  := $(BUILD_PKGS)

.PHONY: all build deps-build deps-test deps-bench test test-asan test-tsan test-gpu demo bench clean format \
        python fuzz fuzz-seeds

all: build

build:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVB_WERROR=$(WERROR) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

deps-build:
	@scripts/install-deps.sh $(BUILD_PKGS)

deps-test:
	@scripts/install-deps.sh $(TEST_PKGS)

deps-bench:
	@scripts/install-deps.sh $(BUILD_PKGS) gnuplot-nox iperf3

# The whole suite, then once more under AddressSanitizer + UndefinedBehaviorSanitizer, then the
# stress programs under ThreadSanitizer.
test: deps-test build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	@$(BUILD)/gpu_engine --probe || true
	$(MAKE) test-asan
	$(MAKE) test-tsan
	$(MAKE) fuzz FUZZ_SECS=3

# Coverage-guided fuzzing (tests/fuzz/): each libFuzzer harness runs FUZZ_SECS seconds (make
# test: 3, as a smoke test) from its seed corpus in the repository, built with clang, ASan and
# UBSan in $(FUZZ_BUILD). A finding fails and leaves its input in $(FUZZ_BUILD)/fuzz-artifacts/.
fuzz: deps-test
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug -DKVB_TESTS=OFF \
	      -DKVB_FUZZ=ON -DKVB_FUZZ_SECS=$(FUZZ_SECS) -DKVB_WERROR=$(WERROR) >/dev/null
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzzers
	cd $(FUZZ_BUILD) && ctest --output-on-failure -j $(JOBS) -L fuzz

# Rewrites the seed corpora from the encoders (after a format change; commit what changed).
fuzz-seeds: fuzz
	$(FUZZ_BUILD)/make_seeds tests/fuzz/corpus
	$(BUILD)/kvbridge model init --preset tiny-gqa --out $(FUZZ_BUILD)/tiny.kvbw >/dev/null || \
	    { $(MAKE) build && $(BUILD)/kvbridge model init --preset tiny-gqa --out $(FUZZ_BUILD)/tiny.kvbw; }
	head -c 4096 $(FUZZ_BUILD)/tiny.kvbw > tests/fuzz/corpus/weights/tiny-gqa-head

# The GPU tests (tests/gpu/) on a machine with a CUDA GPU. KVB_PREBUILT=1 runs a build tree made
# on another machine (a GPU machine without the build dependencies) instead of building here.
test-gpu:
ifndef KVB_PREBUILT
	$(MAKE) deps-build build
endif
	sh tests/gpu/run.sh $(BUILD)

test-asan: deps-test
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKVB_SANITIZE=ON -DKVB_WERROR=$(WERROR) >/dev/null
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ctest --output-on-failure -j $(JOBS)

# The engine, transport and lifecycle paths under ThreadSanitizer: stress programs (tests/tsan/)
# with peers in real processes, any TSan report fails. Criterion aborts under TSan, hence no
# Criterion suites in this build; the runs go one at a time (each keeps both cores busy).
test-tsan: deps-test
	cmake -S . -B $(TSAN_BUILD) -DKVB_TSAN=ON -DKVB_TESTS=OFF -DCMAKE_BUILD_TYPE=Debug -DKVB_WERROR=$(WERROR) >/dev/null
	cmake --build $(TSAN_BUILD) -j $(JOBS)
	cd $(TSAN_BUILD) && ctest --output-on-failure

# Ten minutes (SOAK_SECS) of mixed load on a PD deployment (two prefills, two decodes, the proxy
# discovering them) while a prefill and a decode are SIGKILLed and restarted at random moments
# (tests/pd/soak.py): fails on a failed request that was not in flight on a killed instance, an
# answer that differs from a colocated instance's, or blocks held once the load stops. Not part
# of `make test`.
SOAK_SECS ?= 600
.PHONY: soak
soak: build
	python3 tests/pd/soak.py --bin $(BUILD)/kvbridge --seconds $(SOAK_SECS)

# The PD serving demo: proxy, prefill (TP 2), decode (TP 1) and a colocated reference instance on
# loopback; prompts through both; fails on any difference.
demo: deps-build build
	$(BUILD)/kvbridge demo

# The benchmark suite (about 9 minutes on 2 cores): writes bench/results/ (CSV, Markdown, PNG).
bench: deps-bench build
	bench/run.sh

# The Python package (python/) for the interpreter the Python tests use (Debian's): builds and
# installs the library (cmake --install, default prefix /usr/local), then installs the package
# offline (its build backend is in-tree: nothing is downloaded). PYTHON=... picks another one.
PYTHON ?= /usr/bin/python3
python: deps-build build
	@scripts/install-deps.sh python3-pip
	cmake --install $(BUILD) >/dev/null
	-ldconfig
	PIP_BREAK_SYSTEM_PACKAGES=1 $(PYTHON) -m pip install --no-index --no-deps --force-reinstall \
		--root-user-action=ignore ./python
	cd / && $(PYTHON) -c "import kvbridge; print('kvbridge', kvbridge.__version__, 'on', kvbridge.library_path())"

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(FUZZ_BUILD)

format:
	clang-format -i $$(git ls-files '*.c' '*.h')
