#!/bin/sh
# examples/python/kv_connector.py across two lab VMs: prefill on VM 0, decode on VM 1, 8 requests
# (the last all 256 blocks of every layer), every block checked. Usage: connector.sh PYTHON
set -u
PY=$1
ex=$(dirname "$0")/../../../examples/python/kv_connector.py
set -- $RDMAKIT_LAB_IPS
if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
  out=$(timeout 100 "$PY" "$ex" prefill --listen 0.0.0.0:7670 --decode "$2:7671" 2>&1) || { echo "FAIL: prefill exited $?: $out"; exit 1; }
  echo "$out"
  echo "$out" | grep -q "8 requests finished, every lease ended before its blocks were reused" || { echo "FAIL: prefill output"; exit 1; }
else
  out=$(timeout 100 "$PY" "$ex" decode --listen 0.0.0.0:7671 --prefill "$1:7670" 2>&1) || { echo "FAIL: decode exited $?: $out"; exit 1; }
  echo "$out"
  echo "$out" | grep -q "8 requests, every block intact" || { echo "FAIL: decode output"; exit 1; }
fi
