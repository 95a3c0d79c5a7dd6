#!/bin/sh
# The tools over rdma_cm across two lab VMs (two NICs each): devices --to shows the CM's route
# to each of VM 0's networks; hello with a key; doctor --peer; bench with --validate (every operation, four QPs
# striped); a client with the wrong key and one to a port where nothing listens, each refused
# with the reason. VM 0 serves, VM 1 connects; the clients retry until the servers listen.
# Usage: cm_tools.sh PATH_TO_RDMAKIT
set -u
R=$1
set -- $RDMAKIT_LAB_IPS
server=$1
client=$2
out=/tmp/cm_tools.$$
mkdir -p "$out"
fail() { echo "FAIL: $*"; for f in "$out"/*; do echo "--- $f"; cat "$f"; done; exit 1; }
expect() { grep -qF -- "$2" "$1" || fail "$1 lacks: $2"; }
# The same 32-byte key on both VMs, and another for the refusal.
printf '%032d' 7 > "$out/key" && chmod 600 "$out/key"
printf '%032d' 8 > "$out/other" && chmod 600 "$out/other"
cm="--cm rdma_cm --timeout 20000"
benches="write:-q4:-s1048576 read:-q3:-s262144 send:-q1:-s4096 atomic:-q1:-s8"

if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
  # A doctor listener for VM 1's two-sided checks, up until VM 0 is done.
  "$R" doctor --cm rdma_cm --listen 13060 > "$out/doctor" 2>&1 &
  doctor=$!
  timeout 60 "$R" hello $cm --listen 13040 --psk-file "$out/key" > "$out/hello" 2>&1 || fail "hello server exited $?"
  expect "$out/hello" "peer        $client:"
  expect "$out/hello" "(over rdma_cm)"
  expect "$out/hello" 'received: "Hello,World"'
  port=13041
  for b in $benches; do
    op=${b%%:*}; rest=${b#*:}; q=${rest%%:*}; s=${rest#*:}
    timeout 60 "$R" bench $op bw $s $q -n 200 --validate $cm --listen $port > "$out/bench-$op" 2>&1 || fail "bench $op server exited $?"
    port=$((port + 1))
  done
  # A keyed hello server: the client with the wrong key is refused, the next one served.
  timeout 60 "$R" hello $cm --listen 13050 --psk-file "$out/key" > "$out/hello-refusing" 2>&1 || fail "keyed server exited $?"
  expect "$out/hello-refusing" "authentication failed"
  expect "$out/hello-refusing" 'received: "Hello,World"'
  kill $doctor
  cat "$out/hello"
  echo "PASS: rdma_cm tools (server)"
  exit 0
fi

"$R" devices --to "$server" > "$out/route" 2>&1 || fail "devices --to exited $?"
expect "$out/route" "device      rxe0 port 1"
expect "$out/route" "source GID  [1] ::ffff:$client"
expect "$out/route" "dest GID    ::ffff:$server"
expect "$out/route" "path MTU    1024"
# VM 0's second network is reached through the second device.
second=$(echo "$server" | sed 's/^198\.18\.0\./198.18.1./')
"$R" devices --to "$second" --json > "$out/route2" 2>&1 || fail "devices --to $second exited $?"
expect "$out/route2" '"device": "rxe1"'
"$R" devices --to 10.255.0.1 --timeout 1000 > "$out/route-none" 2>&1 && fail "a route to nowhere resolved"
expect "$out/route-none" "rdma_resolve_addr failed"

timeout 60 "$R" hello $cm --connect "$server:13040" --psk-file "$out/key" > "$out/hello" 2>&1 || fail "hello client exited $?"
expect "$out/hello" 'server read back: "Hello,World"'
expect "$out/hello" "remote GID  [1] ::ffff:$server RoCE v2"
port=13041
for b in $benches; do
  op=${b%%:*}; rest=${b#*:}; q=${rest%%:*}; s=${rest#*:}
  timeout 60 "$R" bench $op bw $s $q -n 200 --validate $cm --connect "$server:$port" > "$out/bench-$op" 2>&1 || fail "bench $op client exited $?"
  expect "$out/bench-$op" " validated"
  port=$((port + 1))
done
expect "$out/bench-write" "(+3 more QPs"
timeout 30 "$R" hello $cm --connect "$server:13050" --psk-file "$out/other" > "$out/hello-wrong" 2>&1 && fail "a wrong key connected"
expect "$out/hello-wrong" "failed to prove it knows the pre-shared key"
# While VM 0 still waits for the right key: the doctor over rdma_cm, and a port where nothing
# listens.
i=0
until "$R" doctor --cm rdma_cm --peer "$server:13060" > "$out/doctor" 2>&1; do
  i=$((i + 1)); [ $i -gt 20 ] && fail "doctor --cm rdma_cm --peer failed"; sleep 0.5
done
expect "$out/doctor" "[ok  ] tiny WRITE"
expect "$out/doctor" "[ok  ] tiny SEND"
"$R" doctor --cm rdma_cm --peer "$server:13069" > "$out/doctor-nobody" 2>&1 && fail "doctor passed with no peer"
expect "$out/doctor-nobody" "rdma_cm connection"
expect "$out/doctor-nobody" "fix: nothing listens on that rdma_cm port"
timeout 30 "$R" hello --cm rdma_cm --timeout 1500 --connect "$server:13059" > "$out/hello-nobody" 2>&1 && fail "connected to nothing"
expect "$out/hello-nobody" "nothing listens on that rdma_cm port"
timeout 60 "$R" hello $cm --connect "$server:13050" --psk-file "$out/key" > "$out/hello-right" 2>&1 || fail "the right key was refused"
cat "$out/route" "$out/hello" "$out/bench-write"
echo "PASS: rdma_cm tools (client)"
