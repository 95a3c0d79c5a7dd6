#!/bin/sh
# rdmakit devices and doctor in one lab VM: a healthy setup passes; each induced problem gets its
# diagnosis and a non-zero exit; --json holds the same verdicts as the text.
# Usage: doctor.sh PATH_TO_RDMAKIT
set -u
R=$1
out=/tmp/doctor.$$
mkdir -p "$out"
fail() { echo "FAIL: $*"; for f in "$out"/*; do echo "--- $f"; cat "$f"; done; exit 1; }
dev=$RDMAKIT_LAB_DEVICE
# Whatever happens, leave the VM as it was for the cases after this one in the suite: the link up,
# the device there, its port ACTIVE.
restore() {
  ip link set eth0 up
  [ -e /sys/class/infiniband/$dev ] || rdma link add "$dev" type rxe netdev eth0
  i=0
  until grep -q ACTIVE /sys/class/infiniband/$dev/ports/1/state 2>/dev/null; do
    i=$((i + 1)); [ $i -gt 100 ] && break; sleep 0.1
  done
}
trap restore EXIT

# devices: rxe0, and the GID rdmakit uses is index 1, RoCE v2 with the VM's IPv4 address.
"$R" devices > "$out/devices.txt" 2>&1 || fail "devices exited $?"
grep -q "^$dev " "$out/devices.txt" || fail "devices does not list $dev"
grep -q "rdmakit uses GID 1: RoCE v2 with an IPv4 address" "$out/devices.txt" || fail "devices: chosen GID"
grep -q "netdev eth0: up, MTU 1500, addresses $RDMAKIT_LAB_IP/24" "$out/devices.txt" || fail "devices: netdev"
"$R" devices --json > "$out/devices.json" || fail "devices --json exited $?"
python3 - "$out/devices.json" "$RDMAKIT_LAB_IP" <<'PY' || fail "devices --json"
import json, sys
d = json.load(open(sys.argv[1]))["devices"][0]
p = d["ports"][0]
assert d["name"] == "rxe0" and p["state"] == "ACTIVE" and p["link_layer"] == "Ethernet", d
assert p["chosen_gid"]["index"] == 1 and p["chosen_gid"]["type"] == "RoCE v2", p["chosen_gid"]
assert p["chosen_gid"]["address"] == "::ffff:" + sys.argv[2], p["chosen_gid"]
assert any(g["index"] == 0 and g["address"].startswith("fe80:") for g in p["gids"]), p["gids"]
assert d["memory_windows"] is True, d
PY
grep -q "memory windows type 2" "$out/devices.txt" || fail "devices: memory windows"

# A healthy VM: exit 0, and the JSON says what the text says, check by check.
"$R" doctor > "$out/healthy.txt" 2>&1 || fail "healthy doctor exited $?"
grep -q "^verdict: ok" "$out/healthy.txt" || fail "healthy: verdict"
"$R" doctor --json > "$out/healthy.json" || fail "healthy doctor --json exited $?"
python3 - "$out/healthy.txt" "$out/healthy.json" <<'PY' || fail "json and text disagree"
import json, re, sys
text = [m.group(1).strip() for m in re.finditer(r"^  \[(\w+) *\]", open(sys.argv[1]).read(), re.M)]
j = json.load(open(sys.argv[2]))
assert [c["verdict"] for c in j["local"]["checks"]] == text, (text, j)
assert j["exit_status"] == 0 and j["local"]["verdict"] == "ok", j
w = [c for c in j["local"]["checks"] if c["id"] == "memory_windows"]
assert len(w) == 1 and w[0]["verdict"] == "ok" and "type-2 memory windows" in w[0]["detail"], w
f = [c for c in j["local"]["checks"] if c["id"] == "fork"]
assert len(f) == 1 and f[0]["verdict"] == "ok" and "copies pinned pages for a child" in f[0]["detail"], f
PY

# Locked memory: with a 64 KiB limit and without CAP_IPC_LOCK (which exempts root from the
# limit), registering what a connection needs fails, and doctor says which limit and how to raise.
(ulimit -l 64 && exec setpriv --bounding-set -ipc_lock "$R" doctor) > "$out/memlock.txt" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "memlock: exit $rc, expected 2"
grep -q "\[fail\] locked-memory limit (RLIMIT_MEMLOCK): soft 64 KiB" "$out/memlock.txt" || fail "memlock: no diagnosis"
grep -q "fix: raise RLIMIT_MEMLOCK" "$out/memlock.txt" || fail "memlock: no fix"

# The port down: the netdev is down, doctor says so and how to bring it up.
ip link set eth0 down
"$R" doctor > "$out/down.txt" 2>&1
rc=$?
ip link set eth0 up
[ $rc -eq 2 ] || fail "port down: exit $rc, expected 2"
grep -q "\[fail\] RDMA device and port: $dev port 1 is DOWN (netdev eth0 is down)" "$out/down.txt" || fail "port down: no diagnosis"
grep -q "fix: bring the link up: ip link set eth0 up" "$out/down.txt" || fail "port down: no fix"

# A peer that is not there: the diagnosis names the refused connect.
"$R" doctor --peer 127.0.0.1:1 > "$out/nopeer.txt" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "no peer: exit $rc, expected 2"
grep -q "nothing listens at that address and port" "$out/nopeer.txt" || fail "no peer: no diagnosis"

# Tracing: RDMAKIT_TRACE=json makes any program using the library log JSON lines; --trace does
# the same from the tool (text). Both show each QP transition with its attributes.
"$R" doctor --listen 127.0.0.1:14026 > "$out/listener.txt" 2>&1 &
listener=$!
RDMAKIT_TRACE=json "$R" doctor --peer 127.0.0.1:14026 > "$out/traced.txt" 2> "$out/trace.jsonl" || fail "traced doctor exited $?"
python3 - "$out/trace.jsonl" <<'PY' || fail "RDMAKIT_TRACE=json"
import json, sys
events = [json.loads(line) for line in open(sys.argv[1])]
names = [e["event"] for e in events]
for want in ("hello_sent", "hello_received", "connected", "closed"):
    assert want in names, (want, names)
rtr = [e for e in events if e["event"] == "qp_transition" and e["transition"] == "INIT->RTR"]
assert rtr and rtr[0]["path_mtu"].startswith("1024 (local active 1024, remote active 1024)"), rtr
PY
"$R" doctor --peer 127.0.0.1:14026 --trace > /dev/null 2> "$out/trace.txt" || fail "doctor --trace exited $?"
grep -q "^rdmakit trace: qp_transition qp=0x[0-9a-f]* transition=RTR->RTS .*retry_cnt=3" "$out/trace.txt" || fail "--trace: no RTS transition"
kill $listener

# No device at all (as a lab without rxe0).
rdma link delete "$dev" || fail "rdma link delete"
"$R" doctor > "$out/nodev.txt" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "no device: exit $rc, expected 2"
grep -q "\[fail\] RDMA device and port: no RDMA device" "$out/nodev.txt" || fail "no device: no diagnosis"
grep -q "rdma link add rxe0 type rxe netdev eth0" "$out/nodev.txt" || fail "no device: no fix"
"$R" devices > "$out/nodev-devices.txt" 2>&1 || fail "devices without devices exited $?"
grep -q "no RDMA devices" "$out/nodev-devices.txt" || fail "devices: no devices not said"
echo "PASS: doctor"
