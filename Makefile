# kvferry - top-level build. Everything lands in $(BUILD) (build/, or
# build-san/ with SAN=1 for the ASan+UBSan build).
#
#   make              build daemon, library, kvferryctl, kvferry-bench, tests
#   make check        run every test (unit + black-box with real daemons)
#   make demo         two daemons on loopback, one verified KV-cache handoff
#   make demo-up / demo-down   the same daemons, left running (build/demo/env)
#   make bench-tcp    kvferry vs iperf3 on loopback (bench/tcp_vs_iperf.sh)

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
LDLIBS_D := -luv -lprotobuf-c -lpthread -ldl
LDLIBS_C := -lprotobuf-c -lpthread

PROTO_C := $(BUILD)/proto/kvferry.pb-c.c
PROTO_H := $(BUILD)/proto/kvferry.pb-c.h

COMMON_SRC := proto/frame.c
ERR_SRC := client/errors.c
DAEMON_SRC := $(filter-out daemon/main.c,$(wildcard daemon/*.c daemon/transport/*.c))
LIB_SRC := $(wildcard client/lib*.c) client/errors.c
CTL_SRC := client/kvferryctl.c
BENCH_SRC := bench/kvferry-bench.c

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
pic = $(patsubst %.c,$(BUILD)/pic/%.o,$(1))

DAEMON_OBJ := $(call obj,$(DAEMON_SRC) $(COMMON_SRC) $(ERR_SRC)) $(BUILD)/obj/proto/kvferry.pb-c.o
LIB_PIC := $(call pic,$(LIB_SRC) $(COMMON_SRC)) $(BUILD)/pic/proto/kvferry.pb-c.o

UNIT_SRC := $(wildcard tests/unit/test_*.c)
UNIT_BIN := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(UNIT_SRC))
INTEG_SRC := $(wildcard tests/integration/test_*.c)
INTEG_BIN := $(patsubst tests/integration/%.c,$(BUILD)/tests/%,$(INTEG_SRC))
TESTLIB_SRC := $(wildcard tests/integration/harness.c)

BINS := $(BUILD)/kvferryd $(BUILD)/kvferryctl $(BUILD)/kvferry-bench \
	$(BUILD)/libkvferry.so $(BUILD)/libkvferry.a

.PHONY: all deps check unit integration demo demo-up demo-down bench-tcp clean
.DEFAULT_GOAL := all

all: deps $(BINS) $(UNIT_BIN) $(INTEG_BIN)

# Installs the Debian packages the build and tests need, only when missing.
deps:
	@scripts/install-deps.sh

$(PROTO_C) $(PROTO_H): proto/kvferry.proto | deps
	@mkdir -p $(BUILD)/proto
	protoc-c --proto_path=proto --c_out=$(BUILD)/proto proto/kvferry.proto

$(BUILD)/obj/%.o: %.c $(PROTO_H)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(INC) $(DEPFLAGS) -c $< -o $@

$(BUILD)/obj/proto/kvferry.pb-c.o: $(PROTO_C)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -Wno-error $(INC) -c $< -o $@

$(BUILD)/pic/%.o: %.c $(PROTO_H)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -fPIC $(INC) $(DEPFLAGS) -c $< -o $@

$(BUILD)/pic/proto/kvferry.pb-c.o: $(PROTO_C)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -fPIC -Wno-error $(INC) -c $< -o $@

$(BUILD)/kvferryd: $(BUILD)/obj/daemon/main.o $(DAEMON_OBJ)
	$(CC) $(CFLAGS_BASE) -o $@ $^ $(LDLIBS_D)

# The shared library exports only kvf_* (client/libkvferry.map).
$(BUILD)/libkvferry.so: $(LIB_PIC) client/libkvferry.map
	$(CC) $(CFLAGS_BASE) -shared -Wl,-soname,libkvferry.so.1 \
	  -Wl,--version-script=client/libkvferry.map -o $@ $(LIB_PIC) $(LDLIBS_C)

$(BUILD)/libkvferry.a: $(LIB_PIC)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/kvferryctl: $(call obj,$(CTL_SRC)) $(BUILD)/libkvferry.a
	$(CC) $(CFLAGS_BASE) -o $@ $^ $(LDLIBS_C)

$(BUILD)/kvferry-bench: $(call obj,$(BENCH_SRC)) $(BUILD)/libkvferry.a
	$(CC) $(CFLAGS_BASE) -o $@ $^ $(LDLIBS_C) -lm

# Unit tests link the daemon's objects (all but main) and cmocka.
$(BUILD)/tests/%: tests/unit/%.c $(DAEMON_OBJ) $(BUILD)/libkvferry.a $(PROTO_H)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(INC) -Itests/unit -o $@ $< $(DAEMON_OBJ) $(BUILD)/libkvferry.a \
	  $(LDLIBS_D) -lcmocka

# Black-box tests: real daemons, driven through libkvferry only.
$(BUILD)/tests/%: tests/integration/%.c $(TESTLIB_SRC) $(BUILD)/libkvferry.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -Iclient -Itests/integration -o $@ $< $(TESTLIB_SRC) \
	  $(BUILD)/libkvferry.a $(LDLIBS_C) -lcmocka

check: all
	@BUILD=$(BUILD) tests/run.sh $(UNIT_BIN) $(INTEG_BIN)

unit: all
	@BUILD=$(BUILD) tests/run.sh $(UNIT_BIN)

integration: all
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

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
