#!/bin/sh
# rdmakit serve and rdmakit engine-bench across two lab VMs: VM 0 serves a segment, VM 1 writes
# and reads it with every byte validated (text and JSON), and a missing segment fails with its
# name. With two NICs per VM (the suite's lab), the write runs over both rails and reports each,
# and --rails 1 keeps to one. VM 0 stops at SIGTERM once VM 1 is done and reports what it saw.
# With rdma_cm as the second argument, every link (rails too) connects through the CM.
#   engine_tools.sh PATH_TO_rdmakit [tcp|rdma_cm]
set -u
R=$1
method=${2:-tcp}
cm="--cm $method"
set -- $RDMAKIT_LAB_IPS
done_file=".engine-tools-done-$method-$RDMAKIT_LAB_RUN"
fail() { echo "FAIL: $*"; exit 1; }
if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
  "$R" serve $cm --name target --listen 0.0.0.0:7630 --expose kv:16M --json > serve.out.$$ 2>&1 &
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
  if [ "${RDMAKIT_LAB_NICS:-1}" -ge 2 ]; then
    grep '"event":"serving"' serve.out.$$ | grep -q 'rxe1 port 1 (198.18.1.[0-9]*, 198.18.1.0/24): peers open rails at' \
      || fail "serve does not offer rxe1 as a rail"
  fi
  grep '"event":"stopped"' serve.out.$$ | grep -q '"accepts":[1-9]' || fail "no link was accepted"
  rm -f serve.out.$$ "$done_file"
else
  trap 'touch "$done_file"' EXIT
  out=$("$R" engine-bench $cm --peer target=$1:7630 --op write --block-size 64K --batch-size 32 --duration 1 --validate) \
    || fail "write bench: $out"
  echo "$out"
  echo "$out" | grep -q "validated: every byte" || fail "write not validated"
  # Through rdma_cm only the links differ: the rail limit, reads and a missing segment are the
  # same code as over TCP, checked there.
  if [ "${RDMAKIT_LAB_NICS:-1}" -ge 2 ]; then
    for d in rxe0 rxe1; do
      echo "$out" | grep -q "rail $d port 1 (.*) -> $d port 1 (.*) of target: up, [1-9][0-9]* bytes" \
        || fail "the write did not report bytes on rail $d"
    done
    [ "$method" = tcp ] || exit 0
    out=$("$R" engine-bench $cm --peer target=$1:7630 --op write --block-size 1M --batch-size 4 --duration 1 --rails 1 --validate) \
      || fail "write bench with --rails 1: $out"
    echo "$out"
    echo "$out" | grep -q "rail rxe1 port 1 (.*) of target: unused: past the engine's rail limit" \
      || fail "--rails 1 used rxe1, or did not say why not"
  fi
  out=$("$R" engine-bench $cm --peer target=$1:7630 --op read --block-size 4K --batch-size 128 --threads 2 --duration 1 --validate --json) \
    || fail "read bench: $out"
  echo "$out"
  echo "$out" | grep -q '"mismatches":0' || fail "read mismatches"
  echo "$out" | grep -q '"validated":true' || fail "read not validated"
  out=$("$R" engine-bench $cm --peer target=$1:7630 --segment nope --duration 1 2>&1) && fail "a missing segment succeeded"
  echo "$out"
  echo "$out" | grep -q "no segment 'nope'" || fail "the error does not name the segment"
  echo "$out" | grep -q "it has: kv" || fail "the error does not list the segments there are"
fi
