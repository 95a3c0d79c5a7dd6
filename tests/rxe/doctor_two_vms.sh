#!/bin/sh
# rdmakit doctor --peer across two lab VMs: VM 0 runs `doctor --listen`; VM 1 checks a healthy
# pair, then a GID the peer cannot reach, then a netdev MTU that differs from the peer's.
# Usage: doctor_two_vms.sh PATH_TO_RDMAKIT
set -u
R=$1
set -- $RDMAKIT_LAB_IPS
server=$1
flag=doctor-two-vms.done
up=doctor-two-vms.listening
if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
  rm -f "$flag"
  "$R" doctor --listen 14025 > /tmp/listen.out 2>&1 &
  i=0
  until grep -q "doctor listening" /tmp/listen.out; do i=$((i + 1)); [ $i -gt 300 ] && { echo "FAIL: no listener"; exit 1; }; sleep 0.1; done
  : > "$up"
  i=0
  until [ -e "$flag" ]; do i=$((i + 1)); [ $i -gt 1200 ] && { echo "FAIL: VM 1 never finished"; exit 1; }; sleep 0.1; done
  kill $! 2>/dev/null
  rm -f "$flag" "$up"
  exit 0
fi
# The listener in VM 0 says when it is up (the VMs start together; doctor does not retry).
i=0
until [ -e "$up" ]; do i=$((i + 1)); [ $i -gt 300 ] && { echo "FAIL: VM 0's listener never came up"; exit 1; }; sleep 0.1; done
out=/tmp/doctor2.$$
mkdir -p "$out"
done_() { : > "$flag"; }
fail() { echo "FAIL: $*"; for f in "$out"/*; do echo "--- $f"; cat "$f"; done; done_; exit 1; }

# Healthy: every check ok, the three operations and a round trip.
"$R" doctor --peer "$server:14025" --timeout 20000 > "$out/healthy.txt" 2>&1 || fail "healthy: exit $?"
for t in "link layers" "RoCE versions" "GIDs reach each other" "MTUs" "tiny WRITE" "tiny READ" "tiny SEND" "round trip"; do
  grep -q "\[ok  \] $t" "$out/healthy.txt" || fail "healthy: $t not ok"
done
grep -q "same subnet 198.18.0.0/24" "$out/healthy.txt" || fail "healthy: subnet"

# A GID the peer cannot reach: this side's link-local IPv6 GID (index 0) against its IPv4 one.
"$R" doctor --peer "$server:14025" --gid 0 --json > "$out/gid.json" 2> "$out/gid.err"
rc=$?
[ $rc -eq 2 ] || fail "gid: exit $rc, expected 2"
python3 - "$out/gid.json" <<'PY' || fail "gid: diagnosis"
import json, sys
peer = {c["id"]: c for c in json.load(open(sys.argv[1]))["peer"]["checks"]}
reach = peer["peer.gid_reach"]
assert reach["verdict"] == "fail" and "IPv4" in reach["detail"] and "IPv6" in reach["detail"], reach
assert "same family" in reach["fix"], reach
PY

# Netdev MTUs differ: 2200 here (active MTU 2048), 1500 there (1024): reported, path MTU 1024.
trap 'ip link set eth0 mtu 1500' EXIT  # as it was, for the cases after this one in the suite
ip link set eth0 mtu 2200 || fail "ip link set mtu"
i=0
until grep -q 2048 /sys/class/infiniband/$RDMAKIT_LAB_DEVICE/ports/1/active_mtu 2>/dev/null || \
      "$R" devices --json | grep -q '"active_mtu": 2048'; do
  i=$((i + 1)); [ $i -gt 50 ] && fail "rxe did not take the new MTU"; sleep 0.1
done
"$R" doctor --peer "$server:14025" > "$out/mtu.txt" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "mtu: exit $rc, expected 1 (a warning)"
grep -q "\[warn\] MTUs: active MTU 2048 here, 1024 on the peer: path MTU 1024" "$out/mtu.txt" || fail "mtu: no diagnosis"
grep -q "peer netdev eth0 MTU 1500" "$out/mtu.txt" || fail "mtu: the peer's netdev MTU not shown"
grep -q "\[ok  \] tiny SEND" "$out/mtu.txt" || fail "mtu: the connection should still work at the path MTU"
done_
echo "PASS: doctor two VMs"
