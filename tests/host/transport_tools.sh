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
port=$((20000 + $$ % 12000))  # (below the kernel's ephemeral ports, 32768 on)

mport=$((port + 2))
bport=$((port + 3))
"$bin" serve --name t --listen 127.0.0.1:$port --transport tcp --transport shm --expose kv:64M --json \
  --metrics 127.0.0.1:$mport > "$dir/serve.json" 2> "$dir/serve.err" &
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

# The metrics endpoints (docs/observability.md), read by rdmakit stats while engine-bench runs:
# the initiator's bytes per second under its peer, the target's under the client that moved
# them (as it reports them), and /health.
timeout 60 "$bin" engine-bench --peer t=127.0.0.1:$port --transport tcp --op write --block-size 1M --batch-size 16 \
  --duration 4 --metrics 127.0.0.1:$bport --json > "$dir/bench.json" 2> "$dir/bench.err" &
bench_pid=$!
trap '[ -z "$serve_pid" ] || kill $serve_pid 2>/dev/null; kill $bench_pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 50); do "$bin" stats 127.0.0.1:$bport --json --interval 0.1 > /dev/null 2>&1 && break; sleep 0.1; done
# Both views over the same second, while the bench writes.
"$bin" stats 127.0.0.1:$bport --json --interval 1 > "$dir/stats_bench.json" &
sb=$!
"$bin" stats 127.0.0.1:$mport --json --interval 1 > "$dir/stats_serve.json" || fail "stats of serve's endpoint"
wait $sb || fail "stats of engine-bench's endpoint"
wait $bench_pid || fail "engine-bench with --metrics: $(cat "$dir/bench.err")"
python3 - "$dir/stats_bench.json" "$dir/stats_serve.json" <<'PY' || fail "stats: $(cat "$dir/stats_bench.json" "$dir/stats_serve.json")"
import json, sys
bench, serve = (json.load(open(p)) for p in sys.argv[1:3])
assert bench["health"] == "ok" and serve["health"] == "ok", (bench["health"], serve["health"])
assert bench["bytes_per_s"] > 1e6, bench
assert any(p["peer"] == "t" and p["bytes_per_s"] > 1e6 for p in bench["peers"]), bench["peers"]
assert any(p["path"] == "tcp" and p["bytes_per_s"] > 1e6 for p in bench["paths"]), bench["paths"]
# The target's figure is the client's reports (every 500 ms): within half of the client's own.
assert any(abs(p["bytes_per_s"] / bench["bytes_per_s"] - 1) <= 0.5 for p in serve["served"]), (serve["served"], bench["bytes_per_s"])
print("ok: stats: engine-bench %.0f MB/s to t; serve saw %.0f MB/s from %s" % (
    bench["bytes_per_s"] / 1e6, serve["served"][0]["bytes_per_s"] / 1e6, serve["served"][0]["peer"]))
PY
"$bin" stats 127.0.0.1:$mport --count 1 --interval 0.2 | grep -q "rdmakit stats 127.0.0.1:$mport: engine t, health ok" \
  || fail "stats' text view"

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
