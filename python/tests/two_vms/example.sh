#!/bin/sh
# examples/python/kv_cache.py across two lab VMs. Usage: example.sh PYTHON
set -u
PY=$1
ex=$(dirname "$0")/../../../examples/python/kv_cache.py
set -- $RDMAKIT_LAB_IPS
if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
  out=$(timeout 60 "$PY" "$ex" serve --listen 0.0.0.0:7660) || { echo "FAIL: pool exited $?: $out"; exit 1; }
  echo "$out"
  echo "$out" | grep -q "kv-worker delivered blocks \[3, 17, 42\]: all intact" || { echo "FAIL: pool output"; exit 1; }
else
  i=0
  # The pool starts at the same moment: retry until it listens.
  until out=$("$PY" "$ex" send "$1:7660" --blocks 3,17,42 2>&1); do
    i=$((i + 1)); [ $i -ge 50 ] && { echo "FAIL: worker: $out"; exit 1; }
    sleep 0.3
  done
  echo "$out"
fi
