#!/bin/sh
# The memlock fault test under a 64 KiB RLIMIT_MEMLOCK and without CAP_IPC_LOCK (root has it, and
# the kernel then does not enforce the limit). Usage: memlock.sh FAULT_TEST_BINARY
ulimit -l 64 || exit 1
exec setpriv --bounding-set -ipc_lock env FAULT_MEMLOCK=1 "$1" --gtest_filter='*Memlock*'
