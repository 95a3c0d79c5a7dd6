#!/bin/sh
# Engines of two releases linked across two lab VMs, both ways: VM 0 serves with one binary, VM 1
# writes and reads every byte (validated) with the other, over rdma and over tcp, with a key; then
# a plain `hello` each way. Not in CI (it needs the previous release built, a few minutes); run
# by hand when a wire format changes, as docs/compatibility.md says:
#   git worktree add /tmp/prev <previous release> && cmake -S /tmp/prev -B /tmp/prev/build -G Ninja &&
#   ninja -C /tmp/prev/build rdmakit_cli
#   lab/rdmakit-lab run --vms 2 --share "$PWD" --share /tmp/prev -- \
#     sh "$PWD/tests/compat/previous-release.sh" /tmp/prev/build/tools/rdmakit "$PWD/build/tools/rdmakit" DIR
# DIR: a directory both VMs share (the key and the turn files go there).
set -u
OLD=$1 NEW=$2 DIR=$3
set -- $RDMAKIT_LAB_IPS
peer_ip=$1
fail() { echo "FAIL: $*"; exit 1; }
key="$DIR/compat.key.$RDMAKIT_LAB_RUN"
turn() { echo "$DIR/compat.turn.$RDMAKIT_LAB_RUN.$1"; }
wait_for() {
  i=0
  until [ -e "$1" ]; do i=$((i + 1)); [ $i -gt 1200 ] && fail "waited 120 s for $1"; sleep 0.1; done
}
[ "$RDMAKIT_LAB_INDEX" = 0 ] && { "$NEW" keygen "$key" >/dev/null || fail keygen; touch "$(turn key)"; }
wait_for "$(turn key)"
n=0
for pair in "NEW OLD" "OLD NEW"; do
  set -- $pair
  eval server=\$$1 client=\$$2
  for transport in rdma tcp; do
    n=$((n + 1))
    port=$((7700 + n))
    if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
      "$server" serve --name target --listen 0.0.0.0:$port --expose kv:8M --psk-file "$key" --transport $transport \
        > "$DIR/serve.$n.$RDMAKIT_LAB_RUN" 2>&1 &
      pid=$!
      wait_for "$(turn done.$n)"
      kill -TERM $pid; wait $pid || fail "round $n: $1 serve exited $?"
      grep -q "accepts" "$DIR/serve.$n.$RDMAKIT_LAB_RUN" || cat "$DIR/serve.$n.$RDMAKIT_LAB_RUN"
    else
      for op in write read; do
        out=$("$client" engine-bench --peer target=$peer_ip:$port --psk-file "$key" --transport $transport --op $op \
              --block-size 64K --batch-size 16 --duration 1 --validate 2>&1) \
          || { touch "$(turn done.$n)"; fail "round $n ($1 serves, $2 initiates, $transport, $op): $out"; }
        echo "$out" | grep -q "validated: every byte" || { touch "$(turn done.$n)"; fail "round $n $op not validated: $out"; }
        echo "round $n: $1 serves, $2 initiates over $transport: $op validated"
      done
      touch "$(turn done.$n)"
    fi
  done
done
# A plain connection each way: hello (rdma), keyed.
for pair in "NEW OLD" "OLD NEW"; do
  set -- $pair
  eval server=\$$1 client=\$$2
  n=$((n + 1))
  port=$((7700 + n))
  if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
    timeout 60 "$server" hello --listen $port --psk-file "$key" > "$DIR/hello.$n.$RDMAKIT_LAB_RUN" 2>&1 \
      || { cat "$DIR/hello.$n.$RDMAKIT_LAB_RUN"; fail "hello round $n: $1 server"; }
    echo "hello round $n: $1 server: ok"
  else
    sleep 1
    out=$(timeout 60 "$client" hello --connect $peer_ip:$port --psk-file "$key" 2>&1) || fail "hello round $n: $2 client: $out"
    echo "hello round $n: $2 client: $(echo "$out" | tail -1)"
  fi
done
# VM 0 leaves nothing behind in DIR (VM 1 is done with it once its last hello returned).
[ "$RDMAKIT_LAB_INDEX" = 0 ] && rm -f "$key" "$DIR"/compat.turn."$RDMAKIT_LAB_RUN".* "$DIR"/serve.*."$RDMAKIT_LAB_RUN" \
  "$DIR"/hello.*."$RDMAKIT_LAB_RUN"
echo "PASS"
