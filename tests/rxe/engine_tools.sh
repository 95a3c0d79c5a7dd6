#!/bin/sh
# rdmakit serve and rdmakit engine-bench across two lab VMs: VM 0 serves a segment, VM 1 writes
# and reads it with every byte validated (text and JSON), and a missing segment fails with its
# name. VM 0 stops at SIGTERM once VM 1 is done and reports what it saw.
#   engine_tools.sh PATH_TO_rdmakit
set -u
R=$1
set -- $RDMAKIT_LAB_IPS
done_file=".engine-tools-done-$RDMAKIT_LAB_RUN"
fail() { echo "FAIL: $*"; exit 1; }
if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
  "$R" serve --name target --listen 7630 --expose kv:16M --json > serve.out.$$ 2>&1 &
  pid=$!
  i=0
  until [ -e "$done_file" ]; do
    i=$((i + 1)); [ $i -gt 1200 ] && { kill $pid; fail "VM 1 never finished"; }
    sleep 0.1
  done
  kill -TERM $pid; wait $pid || fail "serve exited $?"
  cat serve.out.$$
  grep -q '"event":"serving"' serve.out.$$ || fail "no serving line"
  grep -q '"memory_windows":true' serve.out.$$ || fail "rxe has type-2 windows"
  grep '"event":"stopped"' serve.out.$$ | grep -q '"accepts":[1-9]' || fail "no link was accepted"
  rm -f serve.out.$$ "$done_file"
else
  trap 'touch "$done_file"' EXIT
  out=$("$R" engine-bench --peer target=$1:7630 --op write --block-size 64K --batch-size 32 --duration 1 --validate) \
    || fail "write bench: $out"
  echo "$out"
  echo "$out" | grep -q "validated: every byte" || fail "write not validated"
  out=$("$R" engine-bench --peer target=$1:7630 --op read --block-size 4K --batch-size 128 --threads 2 --duration 1 --validate --json) \
    || fail "read bench: $out"
  echo "$out"
  echo "$out" | grep -q '"mismatches":0' || fail "read mismatches"
  echo "$out" | grep -q '"validated":true' || fail "read not validated"
  out=$("$R" engine-bench --peer target=$1:7630 --segment nope --duration 1 2>&1) && fail "a missing segment succeeded"
  echo "$out"
  echo "$out" | grep -q "no segment 'nope'" || fail "the error does not name the segment"
  echo "$out" | grep -q "it has: kv" || fail "the error does not list the segments there are"
fi
