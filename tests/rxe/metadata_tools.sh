#!/bin/sh
# The command line with a metadata store, in one lab VM, once through Redis and once through etcd
# (both started here): two `rdmakit serve` targets publish themselves, `rdmakit peers` lists them
# (text and JSON, segments included), `rdmakit engine-bench` drives them by name with every byte
# validated, a name the store lacks fails naming it, and a SIGKILLed serve's entry leaves the store
# (lease 2 s): the time is reported, and only an entry still there after 6 s fails here. Each look
# is a `rdmakit peers` process, hundreds of ms on a loaded lab host (4.1 s was seen with etcd),
# so the bound the issue sets, the lease and one second, is checked in-process, where looks are
# cheap: tests/rxe/metadata_test.cpp.
#   metadata_tools.sh PATH_TO_rdmakit
set -u
R=$1
d=$(mktemp -d /tmp/metadata-tools.XXXXXX)
pids=""
cleanup() { kill $pids 2>/dev/null; wait 2>/dev/null; rm -rf "$d"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$d"/*.out "$d"/*.log; do [ -e "$f" ] && { echo "== $f"; tail -20 "$f"; }; done; exit 1; }
lists() { "$R" peers --metadata "$1" --cluster lab --json 2>/dev/null | grep -q "\"name\":\"$2\""; }
ms() { echo $(( $(date +%s%N) / 1000000 )); }

redis-server --port 6399 --bind 127.0.0.1 --save '' --appendonly no --dir "$d" > "$d/redis.log" 2>&1 &
pids="$pids $!"
etcd --name lab --data-dir "$d/etcd" --listen-client-urls http://127.0.0.1:2399 \
  --advertise-client-urls http://127.0.0.1:2399 --listen-peer-urls http://127.0.0.1:2398 \
  --initial-advertise-peer-urls http://127.0.0.1:2398 --initial-cluster lab=http://127.0.0.1:2398 \
  > "$d/etcd.log" 2>&1 &
pids="$pids $!"

for u in redis://127.0.0.1:6399 etcd://127.0.0.1:2399; do
  s=${u%%:*}
  i=0
  until "$R" peers --metadata "$u" --cluster lab > /dev/null 2>&1; do
    i=$((i + 1)); [ $i -gt 300 ] && fail "$s never answered"
    sleep 0.1
  done
  "$R" serve --name t1 --metadata "$u" --cluster lab --lease 2 --listen 0.0.0.0:7641 --expose kv:8M --json > "$d/t1.$s.out" 2>&1 &
  t1=$!
  "$R" serve --name t2 --metadata "$u" --cluster lab --lease 2 --listen 0.0.0.0:7642 --expose kv:8M --json > "$d/t2.$s.out" 2>&1 &
  t2=$!
  pids="$pids $t1 $t2"
  i=0
  until lists "$u" t1 && lists "$u" t2; do
    i=$((i + 1)); [ $i -gt 300 ] && fail "$s: t1 and t2 never both listed"
    sleep 0.1
  done
  grep -q '"metadata":"published as \\"t1\\"' "$d/t1.$s.out" || fail "$s: serve does not say it is published"
  echo "== $s: rdmakit peers"
  "$R" peers --metadata "$u" --cluster lab || fail "$s: peers"
  json=$("$R" peers --metadata "$u" --cluster lab --json) || fail "$s: peers --json"
  echo "$json" | grep -q '"segments":\[{"length":8388608,"memory":"host","name":"kv"}\]' || fail "$s: segments not listed: $json"
  echo "$json" | grep -q '"endpoints":\["198.18.0.1:7641"\]' || fail "$s: t1's endpoint is not its RDMA port's address: $json"
  echo "$json" | grep -q '"subnet":"198.18.0.0/24"' || fail "$s: the rail's subnet is missing: $json"
  out=$("$R" engine-bench --metadata "$u" --cluster lab --peer t1 --peer t2 --op write --block-size 64K \
          --batch-size 16 --duration 0.3 --validate) || fail "$s: write bench by name: $out"
  echo "$out"
  echo "$out" | grep -q "validated: every byte" || fail "$s: write not validated"
  out=$("$R" engine-bench --metadata "$u" --cluster lab --peer t1 --peer t2 --op read --block-size 4K \
          --batch-size 64 --duration 0.3 --validate --json) || fail "$s: read bench by name: $out"
  echo "$out" | grep -q '"mismatches":0' || fail "$s: read mismatches: $out"
  out=$("$R" engine-bench --metadata "$u" --cluster lab --peer nobody --duration 1 2>&1) \
    && fail "$s: a name the store does not have was found"
  echo "$out"
  echo "$out" | grep -q 'no engine "nobody" in cluster "lab"' || fail "$s: the error does not say what is missing"
  kill -KILL $t2
  t0=$(ms)
  while lists "$u" t2; do
    [ $(( $(ms) - t0 )) -gt 8000 ] && fail "$s: t2's entry outlived it by 8 s"
    sleep 0.05
  done
  gone=$(( $(ms) - t0 ))
  echo "$s: t2's entry gone $gone ms after its SIGKILL (lease 2 s), as \`rdmakit peers\` saw it"
  [ "$gone" -le 6000 ] || fail "$s: the entry outlived its engine by more than 6 s"
  lists "$u" t1 || fail "$s: t1 went too"
  kill -TERM $t1
  wait $t1 || fail "$s: serve t1 exited $?"
  lists "$u" t1 && fail "$s: t1's entry stayed after a clean stop"
done
echo "PASS: serve, peers and engine-bench by name through Redis and etcd"
