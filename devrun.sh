#!/bin/bash
export LD_LIBRARY_PATH=$PWD/.devcarry/lib PATH=$PWD/.devcarry/bin:$PATH BUILD=.devcarry/build
nvidia-smi -L
echo "== gpu_ipc test"; timeout 200 $BUILD/tests/gpu/gpu_ipc test 2>&1 | tail -30
echo "== gpu_ipc bench"; timeout 200 $BUILD/tests/gpu/gpu_ipc --bench 64G 2>&1 | tail -10
echo "== engine gpu py"; timeout 300 python3 tests/gpu/test_engine_gpu.py 2>&1 | tail -60
