#!/bin/sh
# examples/engine_write_read across two lab VMs. Usage: engine_example.sh PATH_TO_engine_write_read
set -u
X=$1
set -- $RDMAKIT_LAB_IPS
if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
  out=$("$X" --serve 7640) || { echo "FAIL: server exited $?: $out"; exit 1; }
  echo "$out"
  [ "$out" = "from client: hello through the engine" ] || { echo "FAIL: unexpected server output"; exit 1; }
else
  out=$("$X" "$1:7640") || { echo "FAIL: client exited $?: $out"; exit 1; }
  echo "$out"
  [ "$out" = "read back: hello through the engine" ] || { echo "FAIL: unexpected client output"; exit 1; }
fi
