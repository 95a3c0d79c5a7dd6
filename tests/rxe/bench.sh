#!/bin/sh
# rdmakit bench inside one lab VM: every operation and mode with --validate, event mode, a size
# sweep, and JSON output.
# With rdma_cm, the runs whose outcome depends on how the connection was made go through the CM
# (to the VM's own address): every operation and mode, events, several QPs (the server follows
# the client's count), both directions, a size mismatch refused at the handshake. The rest
# (memory providers, sweeps, --duration, JSON) is the same data path once connected, and runs
# over TCP only.
# Usage: bench.sh PATH_TO_RDMAKIT [tcp|rdma_cm]
set -u
R=$1
method=${2:-tcp}
host=127.0.0.1
[ "$method" = rdma_cm ] && host=$RDMAKIT_LAB_IP
out=/tmp/bench.$$
mkdir -p "$out"
fail() { echo "FAIL: $*"; for f in "$out"/*; do echo "--- $f"; cat "$f"; done; exit 1; }

run() {  # run NAME ARGS... : server and client with the same arguments, each with a deadline
  name=$1; shift
  echo "== $name: $*"
  timeout 60 "$R" bench "$@" --cm $method --listen $host:12026 > "$out/$name.server" 2>&1 &
  server=$!
  timeout 60 "$R" bench "$@" --cm $method --connect $host:12026 > "$out/$name.client" 2>&1 || fail "$name: client exited $?"
  wait $server || fail "$name: server exited $?"
}
mismatch() {  # a client asking for another size than the server's is told why
  timeout 60 "$R" bench write bw -s 64 --cm $method --listen $host:12027 > "$out/mismatch.server" 2>&1 &
  timeout 60 "$R" bench write bw -s 1048576 --cm $method --connect $host:12027 > "$out/mismatch.client" 2>&1 \
    && fail "mismatch accepted"
  wait
  grep -q "give the server the same --size" "$out/mismatch.client" || fail "mismatch: no explanation"
}

for op in write read send atomic; do
  for mode in bw lat; do
    size=4096
    [ $op = atomic ] && size=8
    run "$op-$mode" $op $mode -s $size -n 300 --validate
    if [ $mode = bw ]; then
      grep -q "validated" "$out/$op-$mode.client" || fail "$op $mode: not validated"
      grep -q "VALIDATION FAILED" "$out/$op-$mode.client" && fail "$op $mode: validation failed"
    else
      grep -qE "^ $size +300 " "$out/$op-$mode.client" || fail "$op $mode: no result row"
    fi
  done
done

# Completion events instead of polling, and a post list of 1 at depth 1.
run events send bw -s 1024 -n 500 --events --validate
grep -q "completions by events" "$out/events.client" || fail "events: not in event mode"
grep -q " validated" "$out/events.client" || fail "events: not validated"
run depth1 write bw -s 64 -n 200 -t 1 -l 1 --validate
grep -q " validated" "$out/depth1.client" || fail "depth 1: not validated"

if [ "$method" = rdma_cm ]; then
  grep -q "connected over rdma_cm" "$out/write-bw.client" || fail "rdma_cm: the client does not say it went through the CM"
  grep -q "connected over rdma_cm" "$out/write-bw.server" || fail "rdma_cm: the server does not say it went through the CM"
  run qps-stripe write bw -s 1048576 -n 40 -q 4 --validate
  grep -q "(+3 more QPs" "$out/qps-stripe.server" || fail "qps: the server did not follow the client's QP count"
  grep -q " validated" "$out/qps-stripe.client" || fail "qps-stripe: not validated"
  run bidir-send send bw -s 8192 -n 300 --bidir --validate
  grep -q "done, validated" "$out/bidir-send.server" || fail "bidir send: the server's side not validated"
  mismatch
  echo "PASS: bench through rdma_cm"
  exit 0
fi

# --duration: one second of writes, and of sends (the receiver learns the count at the end).
for op in write send; do
  run "duration-$op" $op bw -s 4096 -D 1 --validate
  grep -q " validated" "$out/duration-$op.client" || fail "duration $op: not validated"
done
run duration-json read bw -s 4096 -D 1 --json
python3 -c "
import json
r = json.load(open('$out/duration-json.client'))['results'][0]
assert 0.95 <= r['seconds'] < 3 and r['iterations'] > 0, r
" || fail "duration: the run did not last about one second"

# Several QPs: small chains spread over them, 1 MiB messages striped across all four, reads over
# three; then every size of a sweep over two QPs. Each validated.
run qps-write write bw -s 4096 -n 400 -q 4 --validate
grep -q "(+3 more QPs" "$out/qps-write.client" || fail "qps: the connection does not have 4 QPs"
grep -q "(+3 more QPs" "$out/qps-write.server" || fail "qps: the server did not follow the client's QP count"
run qps-stripe write bw -s 1048576 -n 40 -q 4 --validate
run qps-read read bw -s 262144 -n 60 -q 3 --validate
for t in qps-write qps-stripe qps-read; do
  grep -q " validated" "$out/$t.client" || fail "$t: not validated"
done
run qps-sweep read bw --all -n 4 -q 2 --validate
[ "$(grep -c ' validated' "$out/qps-sweep.client")" -eq 23 ] || fail "qps sweep: expected 23 validated sizes"
timeout 20 "$R" bench send bw -q 2 --connect 127.0.0.1:1 > "$out/qps-send" 2>&1 && fail "send --qps 2 accepted"
grep -q "SEND/RECV and atomics stay on one QP" "$out/qps-send" || fail "send --qps: no explanation"

# Both directions at once; each side checks what the other wrote, read or sent.
for op in write read send; do
  run "bidir-$op" $op bw -s 8192 -n 300 --bidir --validate
  grep -q "bidirectional" "$out/bidir-$op.client" || fail "bidir $op: not bidirectional"
  grep -q " validated" "$out/bidir-$op.client" || fail "bidir $op: not validated"
  grep -q "done, validated" "$out/bidir-$op.server" || fail "bidir $op: the server's side not validated"
done
run bidir-qps write bw -s 65536 -n 200 --bidir -q 2 --validate
grep -q " validated" "$out/bidir-qps.client" || fail "bidir over two QPs: not validated"

# Memory providers: huge pages, and a dma-buf (from vgem) that rxe cannot register, so it moves
# through a bounce buffer with staging copies; every transfer validated.
for mem in hugepage dmabuf; do
  for op in write read send; do
    run "mem-$mem-$op" $op bw -s 65536 -n 100 --mem $mem --validate
    grep -q " validated" "$out/mem-$mem-$op.client" || fail "--mem $mem $op: not validated"
  done
  run "mem-$mem-lat" write lat -s 4096 -n 100 --mem $mem --validate
done
grep -q "memory: hugepage memory, registered by ibv_reg_mr on host memory" "$out/mem-hugepage-write.client" || fail "hugepage: path not reported"
grep -q "memory: dmabuf memory, registered by a registered host bounce buffer .*ibv_reg_dmabuf_mr: EOPNOTSUPP" \
  "$out/mem-dmabuf-write.client" || fail "dmabuf: EOPNOTSUPP and the bounce path not reported"

# A sweep: 2 B .. 8 MiB, every size validated.
run sweep write bw --all -n 4 --validate
[ "$(grep -c ' validated' "$out/sweep.client")" -eq 23 ] || fail "sweep: expected 23 validated sizes"

# JSON parses and carries the figures.
run json read lat -s 64 -n 100 --json
python3 -c "
import json, sys
j = json.load(open('$out/json.client'))
r = j['results'][0]
assert j['op'] == 'read' and r['bytes'] == 64 and r['iterations'] == 100, j
assert 0 < r['t_min_us'] <= r['t_median_us'] <= r['t_p99_us'] <= r['t_max_us'], r
" || fail "json output"

# Mismatched sizes are refused with an explanation.
mismatch
echo "PASS: bench"
