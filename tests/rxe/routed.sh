#!/bin/sh
# Routed RoCE v2 across subnets, three lab VMs with two NICs each (networks 198.18.0.0/24 and
# 198.18.1.0/24): A (VM 0) keeps only its first network, B (VM 1) only its second, and R (VM 2)
# forwards between them. Between A and B, with both connection methods (TCP bootstrap and
# rdma_cm): hello with a key, bench --validate (a 1 MiB write striped over four QPs), and the
# engine (serve, engine-bench --validate). Over rdma_cm also: a wrong key and a port where
# nothing listens, each refused with the reason, and doctor --peer. Then on B, wrong routes: none
# at all, and one through a gateway that does not answer, each a clear error from the CM before
# the deadline, not a hang.
# Usage: routed.sh PATH_TO_RDMAKIT
set -u
R=$1
set -- $RDMAKIT_LAB_IPS
a0=$1; r0=$3
set -- $RDMAKIT_LAB_IPS1
b1=$2; r1=$3
me=$RDMAKIT_LAB_INDEX
sync=".routed-$RDMAKIT_LAB_RUN"
mkdir -p "$sync"
out=/tmp/routed.$$
mkdir -p "$out"
fail() { echo "FAIL: $*"; for f in "$out"/*; do echo "--- $f"; cat "$f"; done; : > "$sync/failed"; exit 1; }
expect() { grep -qF -- "$2" "$1" || fail "$1 lacks: $2"; }
await() {  # await NAME: until VM files NAME exists (or a VM failed), 120 s at most
  i=0
  until [ -e "$sync/$1" ]; do
    [ -e "$sync/failed" ] && { echo "FAIL: another VM failed"; exit 1; }
    i=$((i + 1)); [ $i -gt 1200 ] && fail "never saw $1"
    sleep 0.1
  done
}

# The topology. Addresses are flushed too: a route over a link that is down can still be used.
case $me in
0) ip addr flush dev eth1 && ip link set eth1 down && ip route add 198.18.1.0/24 via "$r0" || fail "A's setup" ;;
1) ip addr flush dev eth0 && ip link set eth0 down && ip route add 198.18.0.0/24 via "$r1" || fail "B's setup" ;;
2) sysctl -qw net.ipv4.ip_forward=1 || fail "R's setup" ;;
esac
: > "$sync/ready.$me"
await ready.0; await ready.1; await ready.2

key="$out/key"
printf '%032d' 5 > "$key" && chmod 600 "$key"
case $me in
0)  # A serves, one method after the other (TCP and rdma_cm ports are separate spaces).
  "$R" doctor --cm rdma_cm --listen 13110 > "$out/doctor" 2>&1 &
  doctor=$!
  for m in tcp rdma_cm; do
    timeout 90 "$R" hello --cm $m --listen 13100 --psk-file "$key" > "$out/hello-$m" 2>&1 || fail "hello $m server exited $?"
    expect "$out/hello-$m" "peer        $b1:"
    expect "$out/hello-$m" 'received: "Hello,World"'
    [ $m = tcp ] || expect "$out/hello-$m" "authentication failed"
    timeout 90 "$R" bench write bw -s 1048576 -q 4 -n 40 --validate --cm $m --listen 13101 --psk-file "$key" > "$out/bench-$m" 2>&1 \
      || fail "bench $m server exited $?"
    "$R" serve --cm $m --name a --listen 13102 --psk-file "$key" --expose kv:4M > "$out/serve-$m" 2>&1 &
    pid=$!
    await "engine-done-$m"
    kill -TERM $pid; wait $pid || fail "serve $m exited $?"
    : > "$sync/server-done-$m"
  done
  await b-doctor-done
  kill $doctor
  cat "$out/hello-rdma_cm"
  : > "$sync/a-done"
  echo "PASS: routed (A)"
  ;;
1)  # B connects to A's address on the other subnet.
  ip route get "$a0" > "$out/route-ip" 2>&1
  expect "$out/route-ip" "via $r1"
  "$R" devices --to "$a0" > "$out/route" 2>&1 || fail "devices --to exited $?"
  expect "$out/route" "device      rxe1 port 1"
  expect "$out/route" "source GID  [1] ::ffff:$b1"
  expect "$out/route" "dest GID    ::ffff:$a0"
  printf '%032d' 6 > "$out/other" && chmod 600 "$out/other"
  for m in tcp rdma_cm; do
    if [ $m = rdma_cm ]; then
      timeout 90 "$R" hello --cm $m --timeout 60000 --connect "$a0:13100" --psk-file "$out/other" > "$out/hello-wrong" 2>&1 \
        && fail "a wrong key connected"
      expect "$out/hello-wrong" "failed to prove it knows the pre-shared key"
    fi
    timeout 90 "$R" hello --cm $m --timeout 60000 --connect "$a0:13100" --psk-file "$key" > "$out/hello-$m" 2>&1 \
      || fail "hello $m client exited $?"
    expect "$out/hello-$m" 'server read back: "Hello,World"'
    expect "$out/hello-$m" "device      rxe1 port 1"
    expect "$out/hello-$m" "remote GID  [1] ::ffff:$a0 RoCE v2"
    timeout 90 "$R" bench write bw -s 1048576 -q 4 -n 40 --validate --cm $m --timeout 60000 --connect "$a0:13101" \
      --psk-file "$key" > "$out/bench-$m" 2>&1 || fail "bench $m client exited $?"
    expect "$out/bench-$m" " validated"
    expect "$out/bench-$m" "(+3 more QPs"
    timeout 90 "$R" engine-bench --cm $m --timeout 60000 --peer "a=$a0:13102" --psk-file "$key" --op write \
      --block-size 64K --batch-size 16 --duration 1 --validate > "$out/engine-$m" 2>&1 || fail "engine-bench $m exited $?"
    expect "$out/engine-$m" "validated: every byte"
    : > "$sync/engine-done-$m"
    await "server-done-$m"
  done
  # The doctor over rdma_cm, and a port where nothing listens.
  # Exit status 1 is a warning: across subnets the doctor says the GIDs are on different ones
  # (reachable only through a router); 2 would be a failure.
  "$R" doctor --cm rdma_cm --peer "$a0:13110" > "$out/doctor" 2>&1
  [ $? -le 1 ] || fail "doctor --cm rdma_cm --peer failed"
  expect "$out/doctor" "[ok  ] tiny WRITE"
  expect "$out/doctor" "[ok  ] tiny SEND"
  "$R" doctor --cm rdma_cm --peer "$a0:13119" > "$out/doctor-nobody" 2>&1 && fail "doctor passed with no peer"
  expect "$out/doctor-nobody" "fix: nothing listens on that rdma_cm port"
  timeout 30 "$R" hello --cm rdma_cm --timeout 3000 --connect "$a0:13119" > "$out/hello-nobody" 2>&1 && fail "connected to nothing"
  expect "$out/hello-nobody" "nothing listens on that rdma_cm port"
  : > "$sync/b-doctor-done"
  # No route to A's subnet: refused at once, by name.
  ip route del 198.18.0.0/24 via "$r1"
  timeout 30 "$R" hello --cm rdma_cm --timeout 5000 --connect "$a0:13100" > "$out/no-route" 2>&1 && fail "connected without a route"
  expect "$out/no-route" "rdma_resolve_addr failed: ENETUNREACH"
  # A route through a gateway that is not there: no neighbour answers; the CM's error comes
  # within the deadline.
  ip route add 198.18.0.0/24 via 198.18.1.99
  t0=$(date +%s)
  timeout 30 "$R" hello --cm rdma_cm --timeout 4000 --connect "$a0:13100" > "$out/dead-gateway" 2>&1 && fail "connected through a dead gateway"
  t1=$(date +%s)
  [ $((t1 - t0)) -le 7 ] || fail "the dead gateway took $((t1 - t0)) s to report (deadline 4 s)"
  grep -qE "rdma_cm (address|route) resolution failed: .*(no neighbour answered|no path to the peer|never answered|no answer before the deadline)" \
    "$out/dead-gateway" || fail "the dead gateway's error does not name the CM step"
  cat "$out/route" "$out/hello-rdma_cm" "$out/no-route" "$out/dead-gateway"
  : > "$sync/b-done"
  echo "PASS: routed (B)"
  ;;
2)  # R forwards until B is done, and removes the meeting files once A is done too (after a
    # failure they stay, for the record).
  await b-done
  await a-done
  rm -rf "$sync"
  echo "PASS: routed (R)"
  ;;
esac
