#!/bin/sh
# A real Prometheus (Debian's) scrapes rdmakit serve's and engine-bench's /metrics every second
# in one lab VM with two NICs (issue 36; serve listens on every address, so both are rails). engine-bench writes for 8 s: Prometheus's
# rate(rdmakit_bytes_total) over the run is within 10% of the GB/s engine-bench reports, the
# peer's label is on its series, and serve's per-client series has the client. Then a second run
# loses its rail on rxe1 (eth1 down) midway: rdmakit_rail_failures_total rises, queried back.
#   prometheus.sh PATH_TO_rdmakit
set -u
R=$1
[ "$RDMAKIT_LAB_INDEX" = 0 ] || exit 0  # one VM does it all (others, were there any, idle)
dir=$(mktemp -d)
pids=
cleanup() {
  kill $pids 2>/dev/null
  ip link set eth1 up 2>/dev/null
  sleep 0.2
  rm -rf "$dir"
}
# Killed at its deadline too: the VM's next case must find eth1 up and the ports free.
trap cleanup EXIT
trap 'exit 1' INT TERM HUP
fail() {
  echo "FAIL: $*"
  for f in serve.out prom.log a.json b.json; do [ -f "$dir/$f" ] && { echo "--- $f"; tail -15 "$dir/$f"; }; done
  exit 1
}
set -- $RDMAKIT_LAB_IPS
ip0=$1

"$R" serve --name t --listen 0.0.0.0:7640 --expose kv:64M --metrics 127.0.0.1:9464 > "$dir/serve.out" 2>&1 &
pids="$pids $!"
cat > "$dir/prom.yml" <<EOF
global: { scrape_interval: 1s, scrape_timeout: 900ms, evaluation_interval: 1s }
scrape_configs:
  - job_name: serve
    static_configs: [{ targets: ["127.0.0.1:9464"] }]
  - job_name: bench
    static_configs: [{ targets: ["127.0.0.1:9465"] }]
EOF
prometheus --config.file="$dir/prom.yml" --storage.tsdb.path="$dir/tsdb" --web.listen-address=127.0.0.1:9090 \
  > "$dir/prom.log" 2>&1 &
pids="$pids $!"

query() {  # query.py's modes: ready, value EXPR TIME
  python3 - "$@" <<'PY'
import json, sys, urllib.parse, urllib.request
def get(path):
    with urllib.request.urlopen("http://127.0.0.1:9090" + path, timeout=5) as r:
        return r.read().decode()
if sys.argv[1] == "ready":
    try:
        get("/-/ready")
        up = json.loads(get("/api/v1/query?" + urllib.parse.urlencode({"query": 'up{job="serve"}'})))["data"]["result"]
        sys.exit(0 if up and up[0]["value"][1] == "1" else 1)
    except Exception:
        sys.exit(1)
expr, t = sys.argv[2], sys.argv[3]
res = json.loads(get("/api/v1/query?" + urllib.parse.urlencode({"query": expr, "time": t})))["data"]["result"]
print(" ".join(r["value"][1] for r in res) if res else "none")
PY
}
i=0
until query ready; do
  i=$((i + 1)); [ $i -gt 300 ] && fail "Prometheus never scraped serve's endpoint"
  sleep 0.1
done
echo "ok: Prometheus scrapes serve's /metrics"

# Run A: 8 s of 64 KiB writes, nothing failing.
t0=$(date +%s.%N)
timeout 20 "$R" engine-bench --peer "t=$ip0:7640" --op write --block-size 64K --batch-size 32 --duration 8 \
  --metrics 127.0.0.1:9465 --json > "$dir/a.json" 2>&1 || fail "engine-bench run A"
t1=$(date +%s.%N)
sleep 2.5  # the last scrapes
python3 - "$dir/a.json" "$t0" "$t1" <<'PY' || fail "run A's figures"
import json, subprocess, sys, urllib.parse, urllib.request
a = json.load(open(sys.argv[1]))
t0, t1 = float(sys.argv[2]), float(sys.argv[3])
def q(expr, t):
    u = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": expr, "time": "%.3f" % t})
    with urllib.request.urlopen(u, timeout=5) as r:
        return json.loads(r.read())["data"]["result"]
reported = a["bytes"] / a["seconds"]
# The run's bytes per second as Prometheus has them: over a window inside the run (its first
# half second connects; the last sample before its end).
window = int(t1 - t0 - 2)
at = t1 - 0.5
got = q('rate(rdmakit_bytes_total{job="bench"}[%ds])' % window, at)
assert got, "no rate of rdmakit_bytes_total from the bench's endpoint"
rate = float(got[0]["value"][1])
print("run A: engine-bench reports %.3f GB/s; Prometheus's rate(rdmakit_bytes_total[%ds]) %.3f GB/s (%.1f%%)"
      % (reported / 1e9, window, rate / 1e9, 100 * (rate / reported - 1)))
assert abs(rate / reported - 1) <= 0.10, "more than 10% apart"
peer = q('rdmakit_peer_bytes_total{job="bench",peer="t"}', at)
assert peer and float(peer[0]["value"][1]) > 0, "no series of peer t on the bench's endpoint"
served = q('rate(rdmakit_peer_served_bytes_total{job="serve",peer!=""}[%ds])' % window, at)
assert served, "serve's endpoint has no client series"
s = float(served[0]["value"][1])
print("run A: serve's rate of what %s moved: %.3f GB/s (%.1f%%)" % (served[0]["metric"]["peer"], s / 1e9, 100 * (s / reported - 1)))
assert abs(s / reported - 1) <= 0.25, "serve's per-client figure is far from what the client moved"
PY

# Run B: once Prometheus has seen the bench's rail on rxe1 up, eth1 goes down; the failover
# counter rises, queried back (a rail whose port went down fails at its event or its next
# completion). One Python process polls Prometheus and takes the link down: a Python started per
# query took so long in a VM sharing its host with another that the bench had ended first.
timeout 40 "$R" engine-bench --peer "t=$ip0:7640" --op write --block-size 64K --batch-size 32 --duration 20 \
  --metrics 127.0.0.1:9465 --json > "$dir/b.json" 2>&1 &
bench=$!
pids="$pids $bench"
python3 - <<'PY' || fail "run B"
import http.client, json, subprocess, sys, time, urllib.parse, urllib.request
def q(expr):
    u = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": expr, "time": "%.3f" % time.time()})
    try:
        with urllib.request.urlopen(u, timeout=5) as r:
            res = json.loads(r.read())["data"]["result"]
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return None  # a slow, cut-short or odd answer in a loaded VM: asked again
    return float(res[0]["value"][1]) if res else None
def until(what, cond, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    sys.exit("run B: " + what)
until("the bench's rail on rxe1 never showed up",
      lambda: q('max(rdmakit_peer_rail_up{job="bench",rail="rxe1 port 1"})') == 1, 12)
before = q('max(rdmakit_rail_failures_total{job="bench"})')
assert before in (None, 0.0), "rail failures before the rail went down: %s" % before
t = time.monotonic()
subprocess.run(["ip", "link", "set", "eth1", "down"], check=True)
after = until("the failover counter did not rise",
              lambda: q('max(max_over_time(rdmakit_rail_failures_total{job="bench"}[30s]))'), 15)
print("run B: rdmakit_rail_failures_total before eth1 went down: %s; %.1f s after: %s" % (before, time.monotonic() - t, after))
PY
wait $bench || fail "engine-bench run B (its other rail carried on?)"
ip link set eth1 up
grep -q '"rails"' "$dir/b.json" || fail "run B's output has no rails"
echo "ok: Prometheus saw the bench's rate, its peer, serve's client, and the failover"
