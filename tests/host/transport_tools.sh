#!/bin/sh
# rdmakit serve and engine-bench over tcp and shm on the host, without RDMA (issue 33): what each
# says it offers and took, batches of more bytes than a stream's turn (16 MiB of 1 MiB writes:
# what a turn left must be read at once, not when the initiator gives up), validated reads, and
# a link with no transport in common failing with both lists.
#   tests/host/transport_tools.sh RDMAKIT
set -eu
bin=$1
dir=$(mktemp -d)
serve_pid=
trap '[ -z "$serve_pid" ] || kill $serve_pid 2>/dev/null; rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
port=$((20000 + $$ % 20000))

"$bin" serve --name t --listen 127.0.0.1:$port --transport tcp --transport shm --expose kv:64M --json \
  > "$dir/serve.json" 2> "$dir/serve.err" &
serve_pid=$!
for _ in $(seq 50); do grep -q serving "$dir/serve.json" 2>/dev/null && break; sleep 0.1; done
grep -q '"transports":\["tcp","shm"\]' "$dir/serve.json" || fail "serve does not say it offers tcp and shm: $(cat "$dir/serve.json")"

for t in tcp shm; do
  for op in write read; do
    timeout 60 "$bin" engine-bench --peer t=127.0.0.1:$port --transport $t --op $op --block-size 1M --batch-size 16 \
      --duration 2 --validate --json > "$dir/bench.json" 2> "$dir/bench.err" \
      || fail "engine-bench $t $op: $(cat "$dir/bench.err")"
    grep -q "\"transport\":\"$t\"" "$dir/bench.json" || fail "engine-bench $t $op took another transport: $(cat "$dir/bench.json")"
    grep -q '"mismatches":0' "$dir/bench.json" || fail "engine-bench $t $op: mismatches"
    grep -q "first choice" "$dir/bench.json" || fail "engine-bench $t $op: no reason for the transport"
  done
  echo "ok: $t: 16 MiB batches of 1 MiB writes and reads, validated"
done

# rdma only (the default) to a target that offers none: refused, saying what each side lists.
if timeout 30 "$bin" engine-bench --peer t=127.0.0.1:$port --transport rdma --duration 1 > "$dir/none.out" 2>&1; then
  if grep -q "no RDMA device" "$dir/none.out"; then :; else fail "an rdma-only link to a tcp/shm target worked"; fi
fi
grep -Eq "no transport both engines offer|no RDMA device" "$dir/none.out" || fail "no reason: $(cat "$dir/none.out")"
echo "ok: no transport in common is refused, saying why"

# What a published engine offers is in its record: `rdmakit peers` lists it, best first.
kill $serve_pid; wait $serve_pid 2>/dev/null || true; serve_pid=
rport=$((port + 1))
redis-server --port $rport --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" > "$dir/redis.log" 2>&1 &
redis_pid=$!
trap '[ -z "$serve_pid" ] || kill $serve_pid 2>/dev/null; kill $redis_pid 2>/dev/null; rm -rf "$dir"' EXIT
u=redis://127.0.0.1:$rport
for _ in $(seq 100); do "$bin" peers --metadata $u --cluster host > /dev/null 2>&1 && break; sleep 0.1; done
"$bin" serve --name t --listen 127.0.0.1:$port --transport shm --transport tcp --expose kv:1M --metadata $u --cluster host \
  > "$dir/serve.out" 2>&1 &
serve_pid=$!
for _ in $(seq 100); do "$bin" peers --metadata $u --cluster host --json 2>/dev/null | grep -q '"name":"t"' && break; sleep 0.1; done
"$bin" peers --metadata $u --cluster host --json > "$dir/peers.json" || fail "peers --json"
grep -q '"transports":\["shm","tcp"\]' "$dir/peers.json" || fail "peers --json does not list shm, tcp: $(cat "$dir/peers.json")"
"$bin" peers --metadata $u --cluster host | grep -q "transports shm, tcp (best first)" || fail "peers does not list the transports"
echo "ok: rdmakit peers lists what a published engine offers"
