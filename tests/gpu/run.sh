#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Runs the GPU test programs of build tree $1 (default build/) and fails if any fails - including
# when there is no GPU to run them on: `make test-gpu` is meant for a GPU machine.
set -u
build=${1:-build}
status=0
for prog in gpu_driver_check gpu_engine; do
    echo "== $prog"
    "$build/$prog"
    rc=$?
    if [ $rc -eq 77 ]; then
        echo "== $prog: SKIPPED (no usable GPU here; see above) - make test-gpu needs a CUDA GPU"
        status=1
    elif [ $rc -ne 0 ]; then
        echo "== $prog: FAILED ($rc)"
        status=1
    else
        echo "== $prog: passed"
    fi
done
exit $status
