# kvferry - top-level build. Everything lands in $(BUILD) (build/, or
# build-san/ with SAN=1 for the ASan+UBSan build).
#
# Building: each target builds what it names, nothing else.
#   make, make all    the product: kvferryd, libkvferry.so (.so.1 -> .so.1.0.0)
#                     and libkvferry.a, kvferryctl, kvferry-bench, the man pages
#   make install      the product, installed: PREFIX=/usr/local DESTDIR= (and
#                     BINDIR, SBINDIR, LIBDIR, ...: see "install" below)
#   make test-build   every test program: tests/unit, tests/integration,
#                     tests/kvferryd-rogue (failpoints), tests/rdma (and
#                     mw_probe), tests/gpu, tests/chaos/chaos_client
#   make bench-tools  desc-bench, post-bench, wake-bench, submit-bench, tcp-pingpong,
#                     tests/gpu/gpu_copy
#                     (what bench/*.sh run besides the product)
#   make fuzz-build   the libFuzzer targets and gen_corpus (clang; "fuzz" below)
# Running: each target first builds what it runs.
#   make check        test-build and bench-tools, then every test that runs
#                     here: unit, integration (real daemons), ops (tests/ops)
#   make unit / integration / check-ops    one part of `make check`
#   make check-scale  32 daemons in network namespaces joining through a real
#                     etcd, kill -9 of a quarter and of etcd under load
#                     (tests/scale/test_scale.py; root; KVF_SCALE_N=N)
#   make demo         two daemons on loopback, one verified KV-cache handoff
#   make demo-up / demo-down   the same daemons, left running (build/demo/env)
#   make bench-tcp    kvferry vs iperf3 on loopback (bench/tcp_vs_iperf.sh)
#   make check-rdma / demo-rdma / bench-rdma   in the soft-RoCE VM (see "rdma" below)
#   make check-gpu    on a GPU machine: tests/gpu (see "cuda" below)
#   make chaos / chaos-vm   kills and network faults (see "chaos" below)
#   make fuzz         libFuzzer targets, FUZZ_SECONDS each (see "fuzz" below)
# Packages (scripts/install-deps.sh): `make`, `make install` and any file
# target only check for the build packages and fail naming those missing;
# the targets that run tests (and bench-tcp: iperf3) install the build and
# test packages when missing, demo, bench-rdma and bench-tools the build
# packages (as root, on Debian). See "packages".

SAN ?= 0
ifeq ($(SAN),1)
BUILD ?= build-san
SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
else
BUILD ?= build
SANFLAGS :=
endif

CC ?= cc
OPT ?= -O2 -g
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Wshadow -Wno-unused-parameter \
	-fvisibility=hidden -pthread $(OPT) $(SANFLAGS)
INC := -I$(BUILD)/proto -Iproto -Iclient -Idaemon
DEPFLAGS = -MMD -MP
LDLIBS_D := -luv -lprotobuf-c -lpthread -ldl -lsystemd -lgcrypt -libverbs -lrdmacm -lcurl
LDLIBS_C := -lprotobuf-c -lpthread -ldl

PROTO_C := $(BUILD)/proto/kvferry.pb-c.c
PROTO_H := $(BUILD)/proto/kvferry.pb-c.h

COMMON_SRC := proto/frame.c
# The JSON writer and reader (proto/json.h): the daemon, kvferryctl,
# kvferry-bench and the tests; not libkvferry, which neither writes nor
# reads JSON.
JSON_SRC := proto/json.c
ERR_SRC := client/errors.c
DAEMON_SRC := $(filter-out daemon/main.c,$(wildcard daemon/*.c daemon/transport/*.c daemon/transport/*/*.c daemon/cuda/*.c))
LIB_SRC := $(wildcard client/lib*.c) client/errors.c
CTL_SRC := $(wildcard client/ctl/*.c)
BENCH_SRC := bench/kvferry-bench.c bench/bench_hetero.c bench/bench_gpu.c

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
pic = $(patsubst %.c,$(BUILD)/pic/%.o,$(1))

DAEMON_OBJ := $(call obj,$(DAEMON_SRC) $(COMMON_SRC) $(ERR_SRC) $(JSON_SRC)) $(BUILD)/obj/proto/kvferry.pb-c.o
LIB_PIC := $(call pic,$(LIB_SRC) $(COMMON_SRC)) $(BUILD)/pic/proto/kvferry.pb-c.o

UNIT_SRC := $(wildcard tests/unit/test_*.c)
UNIT_BIN := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(UNIT_SRC))
INTEG_SRC := $(wildcard tests/integration/test_*.c)
INTEG_BIN := $(patsubst tests/integration/%.c,$(BUILD)/tests/%,$(INTEG_SRC))
TESTLIB_SRC := $(wildcard tests/integration/harness.c) $(JSON_SRC)
ROGUE_BIN := $(BUILD)/tests/kvferryd-rogue

# libkvferry as `make install` lays it out: the real file, its soname, the
# link-time name (cc app.c -Iclient -Lbuild -lkvferry).
LIB_SONAME := libkvferry.so.1
LIB_REAL := libkvferry.so.1.0.0
LIB_SO := $(BUILD)/$(LIB_REAL) $(BUILD)/$(LIB_SONAME) $(BUILD)/libkvferry.so
BINS := $(BUILD)/kvferryd $(BUILD)/kvferryctl $(BUILD)/kvferry-bench $(LIB_SO) $(BUILD)/libkvferry.a
BENCH_TOOLS := $(BUILD)/desc-bench $(BUILD)/post-bench $(BUILD)/wake-bench $(BUILD)/submit-bench \
               $(BUILD)/tcp-pingpong

# Operations tests (tests/ops): Python, stdlib only, TAP on stdout.
OPS_TESTS := $(wildcard tests/ops/test_*.py)
MAN_PAGES := $(addprefix $(BUILD)/man/,kvferryd.8 kvferryd.conf.5 kvferryctl.1 libkvferry.3)

.PHONY: all deps test-build bench-tools check check-scale unit integration demo demo-up demo-down bench-tcp clean
.DEFAULT_GOAL := all

all: $(BINS) $(MAN_PAGES)

test-build: $(UNIT_BIN) $(INTEG_BIN)

bench-tools: $(BENCH_TOOLS)

# ---------------------------------------------------------------- packages
# `deps` is an order-only prerequisite of every compile: none starts before
# it ends (make -j). It runs scripts/install-deps.sh as the goals need: the
# targets that run tests, fuzzers or chaos (and bench-tcp: iperf3) install
# the build and test packages when missing; demo, the other bench and rdma
# targets the build packages (the README's two commands, `make demo` and
# `make check`, work on a fresh Debian 12, as root); all, install and
# anything else only check the build packages (--check: a production host
# gets nothing from apt-get). SKIP_DEPS=1 skips it.
DEPS_TEST_GOALS := test-build check unit integration check-ops check-scale check-gpu check-rdma chaos chaos-vm \
	fuzz fuzz-build bench-tcp
DEPS_BUILD_GOALS := demo demo-up demo-rdma bench-rdma bench-rdma-bounce bench-tools fuzz-corpus
DEPS_ARGS := --check build
ifneq ($(filter $(DEPS_BUILD_GOALS),$(MAKECMDGOALS)),)
DEPS_ARGS := build
endif
ifneq ($(filter $(DEPS_TEST_GOALS),$(MAKECMDGOALS)),)
DEPS_ARGS := build test
endif
deps:
	@[ "$(SKIP_DEPS)" = 1 ] || scripts/install-deps.sh $(DEPS_ARGS)

# One protoc-c writes both files: one rule, or make -j runs two at once.
$(PROTO_H): $(PROTO_C)
$(PROTO_C): proto/kvferry.proto | deps
	@mkdir -p $(BUILD)/proto
	protoc-c --proto_path=proto --c_out=$(BUILD)/proto proto/kvferry.proto

$(BUILD)/obj/%.o: %.c $(PROTO_H) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(INC) $(DEPFLAGS) -c $< -o $@

$(BUILD)/obj/proto/kvferry.pb-c.o: $(PROTO_C) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -Wno-error $(INC) -c $< -o $@

$(BUILD)/pic/%.o: %.c $(PROTO_H) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -fPIC $(INC) $(DEPFLAGS) -c $< -o $@

$(BUILD)/pic/proto/kvferry.pb-c.o: $(PROTO_C) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -fPIC -Wno-error $(INC) -c $< -o $@

$(BUILD)/kvferryd: $(BUILD)/obj/daemon/main.o $(DAEMON_OBJ)
	$(CC) $(CFLAGS_BASE) -o $@ $^ $(LDLIBS_D)

# The shared library exports only kvf_* (client/libkvferry.map).
$(BUILD)/$(LIB_REAL): $(LIB_PIC) client/libkvferry.map
	$(CC) $(CFLAGS_BASE) -shared -Wl,-soname,$(LIB_SONAME) \
	  -Wl,--version-script=client/libkvferry.map -o $@ $(LIB_PIC) $(LDLIBS_C)

$(BUILD)/$(LIB_SONAME): $(BUILD)/$(LIB_REAL)
	ln -sf $(LIB_REAL) $@

$(BUILD)/libkvferry.so: $(BUILD)/$(LIB_SONAME)
	ln -sf $(LIB_SONAME) $@

$(BUILD)/libkvferry.a: $(LIB_PIC)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/kvferryctl: $(call obj,$(CTL_SRC) $(JSON_SRC)) $(BUILD)/libkvferry.a
	$(CC) $(CFLAGS_BASE) -o $@ $^ $(LDLIBS_C)

$(BUILD)/kvferry-bench: $(call obj,$(BENCH_SRC) $(JSON_SRC)) $(BUILD)/libkvferry.a
	$(CC) $(CFLAGS_BASE) -o $@ $^ $(LDLIBS_C) -lm

# The daemon's cost per descriptor before a transport sees it (bench/desc_bench.c).
$(BUILD)/desc-bench: bench/desc_bench.c $(DAEMON_OBJ) $(PROTO_H) | deps
	$(CC) $(CFLAGS_BASE) $(INC) -o $@ $< $(DAEMON_OBJ) $(LDLIBS_D)

# The rdma sender's own cost per descriptor, without a device
# (bench/post_bench.c): it calls the posting code of rdma_post.c and
# rdma_mw.c through rdma_int.h, linked with the daemon's objects.
$(BUILD)/post-bench: bench/post_bench.c $(DAEMON_OBJ) $(PROTO_H) | deps
	$(CC) $(CFLAGS_BASE) $(INC) $(DEPFLAGS) -o $@ $< $(DAEMON_OBJ) $(LDLIBS_D)

# How long the send calls take to return, waiting or not (bench/submit_bench.c).
$(BUILD)/submit-bench: bench/submit_bench.c $(BUILD)/libkvferry.a | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -Iclient -o $@ $< $(BUILD)/libkvferry.a $(LDLIBS_C)

# What one thread or process wake-up costs here (bench/wake_bench.c).
$(BUILD)/wake-bench: bench/wake_bench.c | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -o $@ $< -lpthread

# The raw loopback TCP baseline of bench/latency.sh (bench/tcp_pingpong.c).
$(BUILD)/tcp-pingpong: bench/tcp_pingpong.c | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -o $@ $< -lpthread -lm

# Unit tests link the daemon's objects (all but main) and cmocka.
$(BUILD)/tests/%: tests/unit/%.c $(DAEMON_OBJ) $(BUILD)/libkvferry.a $(PROTO_H) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(INC) -Itests/unit -o $@ $< $(DAEMON_OBJ) $(BUILD)/libkvferry.a \
	  $(LDLIBS_D) -lcmocka

# test_xfer makes kvf__descs_append fail on demand (out of memory): the
# linker sends xfer.c's calls to the test's __wrap_kvf__descs_append.
$(BUILD)/tests/test_xfer: private LDLIBS_D += -Wl,--wrap=kvf__descs_append

# Black-box tests: real daemons, driven through libkvferry only.
$(BUILD)/tests/%: tests/integration/%.c $(TESTLIB_SRC) $(BUILD)/libkvferry.a | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -Iclient -Iproto -Itests/integration -o $@ $< $(TESTLIB_SRC) \
	  $(BUILD)/libkvferry.a $(LDLIBS_C) -lcmocka

# Builds every test program and bench tool, also those it cannot run here
# (rdma, gpu): a change that breaks one fails `make check`.
check: all test-build bench-tools
	@BUILD=$(BUILD) tests/run.sh $(UNIT_BIN) $(INTEG_BIN) $(OPS_TESTS)

# Operations only: systemd, signals, metrics, kvferryctl, install, Python.
check-ops: all
	@BUILD=$(BUILD) tests/run.sh $(OPS_TESTS)

# Root (network namespaces) and etcd (etcd-server); skips loudly without.
check-scale: all
	@BUILD=$(BUILD) tests/run.sh tests/scale/test_scale.py

unit: all $(UNIT_BIN)
	@BUILD=$(BUILD) tests/run.sh $(UNIT_BIN)

integration: all $(INTEG_BIN) $(ROGUE_BIN)
	@BUILD=$(BUILD) tests/run.sh $(INTEG_BIN)

BENCH_ARGS ?= --model llama3-8b --tokens 4096 --json
TRANSPORT ?= tcp
demo: all
	@BUILD=$(BUILD) TRANSPORT=$(TRANSPORT) scripts/demo.sh run $(BENCH_ARGS)

demo-up: all
	@BUILD=$(BUILD) TRANSPORT=$(TRANSPORT) scripts/demo.sh up

demo-down:
	@BUILD=$(BUILD) scripts/demo.sh down

bench-tcp: all
	@BUILD=$(BUILD) bench/tcp_vs_iperf.sh

clean:
	rm -rf build build-san

# ---------------------------------------------------------------- man pages
# kvferryd.conf(5) lists every key from the daemon's own table (its --help),
# so it cannot drift from the parser; the other pages are written by hand.
# Paths (@SYSCONFDIR@ ...) are filled in by `make install`.
VERSION := $(shell sed -n 's/^\#define KVF__VERSION "\(.*\)"/\1/p' daemon/kvferryd.h)

man: $(MAN_PAGES)

$(BUILD)/man/kvferryd.conf.5: docs/kvferryd.conf.5.in scripts/gen-conf-man.py $(BUILD)/kvferryd
	@mkdir -p $(dir $@)
	scripts/gen-conf-man.py $(BUILD)/kvferryd $< $@

$(BUILD)/man/%: docs/% | deps
	@mkdir -p $(dir $@)
	sed 's|@VERSION@|$(VERSION)|g' $< > $@

# ---------------------------------------------------------------- install
# GNU-style directories; everything lands under $(DESTDIR) when set.
# PREFIX=/usr puts the configuration in /etc; any other prefix in $(PREFIX)/etc.
PREFIX ?= /usr/local
EXEC_PREFIX ?= $(PREFIX)
BINDIR ?= $(EXEC_PREFIX)/bin
SBINDIR ?= $(EXEC_PREFIX)/sbin
LIBDIR ?= $(EXEC_PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
DATAROOTDIR ?= $(PREFIX)/share
MANDIR ?= $(DATAROOTDIR)/man
DOCDIR ?= $(DATAROOTDIR)/doc/kvferry
SYSCONFDIR ?= $(if $(filter /usr,$(PREFIX)),/etc,$(PREFIX)/etc)
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
SYSTEMDUNITDIR ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
PYVER := $(shell python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
# Debian's layout: /usr/lib/python3/dist-packages for packages, the versioned
# dist-packages under any other prefix (e.g. /usr/local).
PYTHONDIR ?= $(if $(filter /usr,$(PREFIX)),/usr/lib/python3/dist-packages,$(PREFIX)/lib/python$(PYVER)/dist-packages)

INSTALL ?= install
SUBST = sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@BINDIR@|$(BINDIR)|g' -e 's|@SBINDIR@|$(SBINDIR)|g' \
	-e 's|@LIBDIR@|$(LIBDIR)|g' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' \
	-e 's|@DOCDIR@|$(DOCDIR)|g' -e 's|@SYSTEMDUNITDIR@|$(SYSTEMDUNITDIR)|g' -e 's|@VERSION@|$(VERSION)|g'

.PHONY: man install uninstall check-ops check-gpu
install: all
	$(INSTALL) -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(SBINDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR) \
	  $(DESTDIR)$(PKGCONFIGDIR) $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man3 $(DESTDIR)$(MANDIR)/man5 \
	  $(DESTDIR)$(MANDIR)/man8 $(DESTDIR)$(SYSTEMDUNITDIR) $(DESTDIR)$(SYSUSERSDIR) \
	  $(DESTDIR)$(SYSCONFDIR)/kvferry $(DESTDIR)$(DOCDIR) $(DESTDIR)$(PYTHONDIR)/kvferry
	$(INSTALL) -m 0755 $(BUILD)/kvferryd $(DESTDIR)$(SBINDIR)/kvferryd
	$(INSTALL) -m 0755 $(BUILD)/kvferryctl $(BUILD)/kvferry-bench $(DESTDIR)$(BINDIR)/
	$(INSTALL) -m 0755 $(BUILD)/$(LIB_REAL) $(DESTDIR)$(LIBDIR)/$(LIB_REAL)
	ln -sf $(LIB_REAL) $(DESTDIR)$(LIBDIR)/$(LIB_SONAME)
	ln -sf $(LIB_SONAME) $(DESTDIR)$(LIBDIR)/libkvferry.so
	$(INSTALL) -m 0644 $(BUILD)/libkvferry.a $(DESTDIR)$(LIBDIR)/libkvferry.a
	$(INSTALL) -m 0644 client/kvferry.h $(DESTDIR)$(INCLUDEDIR)/kvferry.h
	$(SUBST) kvferry.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/kvferry.pc
	$(SUBST) $(BUILD)/man/kvferryctl.1 > $(DESTDIR)$(MANDIR)/man1/kvferryctl.1
	$(SUBST) $(BUILD)/man/libkvferry.3 > $(DESTDIR)$(MANDIR)/man3/libkvferry.3
	$(SUBST) $(BUILD)/man/kvferryd.conf.5 > $(DESTDIR)$(MANDIR)/man5/kvferryd.conf.5
	$(SUBST) $(BUILD)/man/kvferryd.8 > $(DESTDIR)$(MANDIR)/man8/kvferryd.8
	$(SUBST) systemd/kvferryd.service.in > $(DESTDIR)$(SYSTEMDUNITDIR)/kvferryd.service
	$(INSTALL) -m 0644 systemd/kvferry.sysusers $(DESTDIR)$(SYSUSERSDIR)/kvferry.conf
	$(INSTALL) -m 0644 config/kvferryd.conf $(DESTDIR)$(DOCDIR)/kvferryd.conf.example
	@# An operator's configuration is never overwritten.
	@if [ -e $(DESTDIR)$(SYSCONFDIR)/kvferry/kvferryd.conf ]; then \
	  echo "kept $(DESTDIR)$(SYSCONFDIR)/kvferry/kvferryd.conf (example in $(DOCDIR))"; \
	else $(INSTALL) -m 0644 config/kvferryd.conf $(DESTDIR)$(SYSCONFDIR)/kvferry/kvferryd.conf; fi
	$(INSTALL) -m 0644 client/python/kvferry/*.py $(DESTDIR)$(PYTHONDIR)/kvferry/
	@if [ -z "$(DESTDIR)" ]; then \
	  ldconfig 2>/dev/null || true; \
	  echo "next: systemd-sysusers; systemctl daemon-reload; systemctl enable --now kvferryd"; fi

uninstall:
	rm -f $(DESTDIR)$(SBINDIR)/kvferryd $(DESTDIR)$(BINDIR)/kvferryctl $(DESTDIR)$(BINDIR)/kvferry-bench \
	  $(DESTDIR)$(LIBDIR)/$(LIB_REAL) $(DESTDIR)$(LIBDIR)/$(LIB_SONAME) $(DESTDIR)$(LIBDIR)/libkvferry.so \
	  $(DESTDIR)$(LIBDIR)/libkvferry.a $(DESTDIR)$(INCLUDEDIR)/kvferry.h $(DESTDIR)$(PKGCONFIGDIR)/kvferry.pc \
	  $(DESTDIR)$(MANDIR)/man1/kvferryctl.1 $(DESTDIR)$(MANDIR)/man3/libkvferry.3 \
	  $(DESTDIR)$(MANDIR)/man5/kvferryd.conf.5 $(DESTDIR)$(MANDIR)/man8/kvferryd.8 \
	  $(DESTDIR)$(SYSTEMDUNITDIR)/kvferryd.service $(DESTDIR)$(SYSUSERSDIR)/kvferry.conf \
	  $(DESTDIR)$(DOCDIR)/kvferryd.conf.example
	rm -rf $(DESTDIR)$(PYTHONDIR)/kvferry
	@echo "kept $(DESTDIR)$(SYSCONFDIR)/kvferry/kvferryd.conf"

# ---------------------------------------------------------------- cuda
# CUDA is loaded at run time (dlopen), so nothing links against it and one
# build runs with and without GPUs. The copy kernel is compiled here by nvcc
# (sm_90 machine code plus compute_90 PTX, which newer GPUs JIT) and embedded
# in kvferryd (daemon/cuda/kernel_image.c); NVCC=path picks one, NVCC= builds
# without it (GPU copies then use cuMemcpy per block, and kvferryd says so).
# The GPU tests and tools (tests/gpu/*.c) build everywhere; CI runs none of
# them, `make check` runs tests/unit/test_cuda_args (the CPU side).
#   make check-gpu    on a machine with GPUs (two for GPU->GPU):
#                     tests/gpu/run.sh, then the Python GPU tests
# SKIP_DEPS=1 skips scripts/install-deps.sh (machines without a registry).
NVCC ?= $(shell command -v nvcc 2>/dev/null || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
NVCC_FLAGS ?= -O3 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
KERNEL_FATBIN := $(if $(NVCC),$(BUILD)/cuda/copy_kernel.fatbin)
ifneq ($(NVCC),)
$(KERNEL_FATBIN): daemon/cuda/copy_kernel.cu daemon/cuda/copy_args.h | deps
	@mkdir -p $(dir $@)
	$(NVCC) -fatbin $(NVCC_FLAGS) -Idaemon/cuda -o $@ $<
$(BUILD)/obj/daemon/cuda/kernel_image.o: $(KERNEL_FATBIN)
$(BUILD)/obj/daemon/cuda/kernel_image.o: CFLAGS_BASE += -DKVF_KERNEL_FATBIN='"$(abspath $(KERNEL_FATBIN))"'
else
$(info kvferry: nvcc not found: building without the CUDA copy kernel (GPU copies fall back to cuMemcpy per block; kvferryd says so at start))
endif

GPU_SRC := $(wildcard tests/gpu/*.c)
GPU_BIN := $(patsubst tests/gpu/%.c,$(BUILD)/tests/gpu/%,$(GPU_SRC))
GPU_PY_TESTS := $(wildcard tests/gpu/test_*.py)
test-build: $(GPU_BIN)
# bench/gpu_local.sh and bench/gpu_tcp_bounce.sh time with it.
bench-tools: $(BUILD)/tests/gpu/gpu_copy

$(BUILD)/tests/gpu/%: tests/gpu/%.c $(DAEMON_OBJ) $(BUILD)/libkvferry.a $(PROTO_H) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(INC) -Itests/gpu -o $@ $< $(DAEMON_OBJ) $(BUILD)/libkvferry.a $(LDLIBS_D) -lm

check-gpu: all $(GPU_BIN)
	@BUILD=$(BUILD) tests/gpu/run.sh
	@BUILD=$(BUILD) tests/run.sh $(GPU_PY_TESTS)

# ---------------------------------------------------------------- rdma
# The rdma transport's tests, demo and benchmark run in the soft-RoCE VM
# (../shared/rdma-vm/run, see its README; it needs root), one boot each:
#   make check-rdma   the black-box suite over rdma, then tests/rdma (100k
#                     descriptors, two devices per node, link down and daemons
#                     killed mid-transfer): tests/rdma/run.sh
#   make demo-rdma    `make demo TRANSPORT=rdma` inside the VM, on two nodes
#   make bench-rdma   bench/rdma_vs_perftest.sh (a benchmark, not a test)
#   make bench-rdma-bounce  bench/rdma_bounce.sh: rdma direct vs rdma-bounce
RDMA_VM ?= $(abspath ../shared/rdma-vm/run)
RDMA_TEST_SRC := $(wildcard tests/rdma/test_*.c)
RDMA_TEST_BIN := $(patsubst tests/rdma/%.c,$(BUILD)/tests/rdma/%,$(RDMA_TEST_SRC))
MW_PROBE := $(BUILD)/tests/rdma/mw_probe
test-build: $(RDMA_TEST_BIN) $(MW_PROBE)

$(BUILD)/tests/rdma/%: tests/rdma/%.c $(TESTLIB_SRC) $(BUILD)/libkvferry.a | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -Iclient -Iproto -Itests/integration -o $@ $< $(TESTLIB_SRC) \
	  $(BUILD)/libkvferry.a $(LDLIBS_C) -lcmocka

# The black-box suite and tests/rdma, and mw_probe first (tests/rdma/run.sh).
check-rdma: all $(INTEG_BIN) $(ROGUE_BIN) $(RDMA_TEST_BIN) $(MW_PROBE)
	@BUILD=$(BUILD) RDMA_VM=$(RDMA_VM) tests/rdma/run.sh

# What a device does with type 2 memory windows, against the real verbs
# (tests/rdma/mw_probe.c; tests/rdma/run.sh prints it first).
$(MW_PROBE): tests/rdma/mw_probe.c | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -o $@ $< -libverbs

# ---------------------------------------------------------------- failpoints
# $(ROGUE_BIN): the daemon's sources again, with
# -DKVF_FAILPOINTS (daemon/failpoint.h) and their own objects, for the tests
# of a peer that misbehaves (tests/integration/test_rogue.c). kvferryd
# itself is built without failpoints.
ROGUE_SRC := daemon/main.c $(filter-out daemon/cuda/kernel_image.c,$(DAEMON_SRC)) $(COMMON_SRC) $(ERR_SRC) $(JSON_SRC)
ROGUE_OBJ := $(patsubst %.c,$(BUILD)/rogue/%.o,$(ROGUE_SRC)) $(BUILD)/obj/daemon/cuda/kernel_image.o \
	$(BUILD)/obj/proto/kvferry.pb-c.o
test-build: $(ROGUE_BIN)

$(BUILD)/rogue/%.o: %.c $(PROTO_H) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -DKVF_FAILPOINTS $(INC) $(DEPFLAGS) -c $< -o $@

$(ROGUE_BIN): $(ROGUE_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -o $@ $^ $(LDLIBS_D)

demo-rdma: all
	$(RDMA_VM) --nodes 2 --mem 4G --timeout 600 -- \
	  env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make --no-print-directory demo TRANSPORT=rdma BUILD=$(BUILD)

bench-rdma: all $(BUILD)/post-bench $(BUILD)/wake-bench
	@BUILD=$(BUILD) RDMA_VM=$(RDMA_VM) bench/rdma_vs_perftest.sh

# rdma direct against rdma-bounce (gpu-direct off), one VM run.
bench-rdma-bounce: all
	@BUILD=$(BUILD) RDMA_VM=$(RDMA_VM) bench/rdma_bounce.sh

.PHONY: check-rdma demo-rdma bench-rdma bench-rdma-bounce

# ---------------------------------------------------------------- fuzz
# libFuzzer targets (tests/fuzz/README.md), built by clang with ASan+UBSan
# into $(BUILD)/fuzz: fuzz_api (the local API, bytes to requests to
# transfers), fuzz_peer (peer messages and tcp data batches), fuzz_config
# (kvferryd.conf). They run one after another, each FUZZ_SECONDS (0: no
# limit) or FUZZ_RUNS executions, from the committed seeds
# (tests/fuzz/corpus) and seeds generated from the current wire format; any
# crash, leak, hang or broken invariant fails the make (input and log in
# $(BUILD)/fuzz/artifacts, $(BUILD)/fuzz/logs).
#   make fuzz [FUZZ_SECONDS=N] [FUZZ_RUNS=N] [FUZZ_TARGETS=fuzz_api] [FUZZ_MAX_LEN=4096]
#             [FUZZ_ARGS=...]
#   make fuzz-build     the targets only
#   make fuzz-corpus    regenerate the committed seeds (tests/fuzz/corpus)
FUZZ_CC ?= clang
FUZZ_RUNS ?=
FUZZ_SECONDS ?= $(if $(FUZZ_RUNS),0,10)
FUZZ_MAX_LEN ?= 4096
FUZZ_ARGS ?=
FUZZ_TARGETS ?= fuzz_api fuzz_peer fuzz_config
FUZZ_DIR := $(BUILD)/fuzz
FUZZ_CFLAGS := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Wshadow -Wno-unused-parameter -pthread -g -O1 \
	-fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_OBJ := $(patsubst %.c,$(FUZZ_DIR)/obj/%.o,$(DAEMON_SRC) $(COMMON_SRC) $(ERR_SRC) $(JSON_SRC) tests/fuzz/fuzz_common.c) \
	$(FUZZ_DIR)/obj/proto/kvferry.pb-c.o
FUZZ_BIN := $(addprefix $(FUZZ_DIR)/,fuzz_api fuzz_peer fuzz_config)

$(FUZZ_DIR)/obj/%.o: %.c $(PROTO_H) | deps
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link $(INC) -Itests/fuzz $(DEPFLAGS) -c $< -o $@

$(FUZZ_DIR)/obj/proto/kvferry.pb-c.o: $(PROTO_C) | deps
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -Wno-error -fsanitize=fuzzer-no-link $(INC) -c $< -o $@

# A static pattern: the objects are named, so make keeps them (no rebuild next time).
$(FUZZ_BIN): $(FUZZ_DIR)/fuzz_%: tests/fuzz/fuzz_%.c $(FUZZ_OBJ)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer $(INC) -Itests/fuzz -o $@ $< $(FUZZ_OBJ) $(LDLIBS_D)

# The seed generator is an ordinary program on the ordinary objects.
$(FUZZ_DIR)/gen_corpus: tests/fuzz/gen_corpus.c $(DAEMON_OBJ) $(PROTO_H) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(INC) -o $@ $< $(DAEMON_OBJ) $(LDLIBS_D)

fuzz-build: $(FUZZ_BIN) $(FUZZ_DIR)/gen_corpus

fuzz: fuzz-build
	@rm -rf $(FUZZ_DIR)/seeds
	@$(FUZZ_DIR)/gen_corpus $(FUZZ_DIR)/seeds config/kvferryd.conf
	@BUILD=$(BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_RUNS=$(FUZZ_RUNS) FUZZ_MAX_LEN=$(FUZZ_MAX_LEN) \
	  FUZZ_ARGS='$(FUZZ_ARGS)' \
	  tests/fuzz/run.sh $(FUZZ_TARGETS)

fuzz-corpus: $(FUZZ_DIR)/gen_corpus
	$(FUZZ_DIR)/gen_corpus tests/fuzz/corpus config/kvferryd.conf

.PHONY: fuzz fuzz-build fuzz-corpus

# ---------------------------------------------------------------- chaos
# The chaos suite (tests/chaos/README.md): kill -9 a daemon or a client at a
# random moment of a transfer; loss, a cut link and a link down between two
# daemons in their own network namespaces (nftables; root); netem delay and
# reordering in the soft-RoCE VM. Every byte of every transfer is verified,
# each daemon's counters (kvferryctl status --json) and open fds return to
# their baseline after each trial, and each daemon exits 0 on SIGTERM at the
# end (LeakSanitizer with SAN=1). One summary line; non-zero exit on a hang,
# leak, corruption or anything unexpected.
#   make chaos [TRIALS=30] [CHAOS_ARGS="--seed N ..."]
#   make chaos-vm [VM_TRIALS=5]     netem trials inside ../shared/rdma-vm
TRIALS ?= 30
VM_TRIALS ?= 5
CHAOS_ARGS ?=
CHAOS_BIN := $(BUILD)/tests/chaos/chaos_client
test-build: $(CHAOS_BIN)

$(CHAOS_BIN): tests/chaos/chaos_client.c $(JSON_SRC) $(BUILD)/libkvferry.a | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -Iclient -Iproto -o $@ $< $(JSON_SRC) $(BUILD)/libkvferry.a $(LDLIBS_C)

chaos: all $(CHAOS_BIN)
	@BUILD=$(BUILD) python3 tests/chaos/chaos.py --trials $(TRIALS) $(CHAOS_ARGS)

chaos-vm: all $(CHAOS_BIN)
	@if [ -x "$(RDMA_VM)" ]; then \
	  $(RDMA_VM) --nodes 2 --mem 3G --timeout 900 -- \
	    env BUILD=$(BUILD) python3 tests/chaos/chaos.py --vm --trials $(VM_TRIALS) $(CHAOS_ARGS); \
	else \
	  echo "chaos-vm: SKIPPED: no VM runner at $(RDMA_VM)"; \
	  echo "chaos: trials 0, completed 0, failed-as-expected 0, hung 0, leaked 0, corrupted 0, skipped $(VM_TRIALS)"; \
	fi

.PHONY: chaos chaos-vm

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
