#!/bin/sh
# Runs the cases of one rxe suite inside one lab boot, one after another, so many cases share a
# boot. CASES_FILE has a line per case: NAME, a tab, TIMEOUT in seconds, a tab, the command. Every
# case runs even when an earlier one failed; a summary with each case's wall time ends the
# output, and the exit status is that of the first failure (0 if none).
# With several VMs, every VM runs every case, and all meet at a barrier before each case (files
# in the shared working directory, named by the lab run's id).
# GoogleTest cases also write JSON reports (GTEST_OUTPUT: a directory in the guest's /tmp, so a
# case that runs several binaries keeps each one's). After the summary, each failed case's
# failures are printed from them: the end of a long log (all a CI page may keep) says which tests
# failed and why.
#   suite.sh CASES_FILE
set -u
cases=$1
reports=$(mktemp -d /tmp/suite-reports.XXXXXX)
vms=$(echo $RDMAKIT_LAB_IPS | wc -w)
meet=".suite-barrier-$RDMAKIT_LAB_RUN"
mkdir -p "$meet"
arrived() {  # arrived NAME: every VM's file for NAME exists
  v=0
  while [ $v -lt "$vms" ]; do
    [ -e "$meet/$1.$v" ] || return 1
    v=$((v + 1))
  done
}
barrier() {  # barrier NAME: every VM has reached NAME (or 120 s have passed)
  : > "$meet/$1.$RDMAKIT_LAB_INDEX"
  i=0
  until arrived "$1"; do
    i=$((i + 1))
    [ $i -gt 2400 ] && { echo "suite: barrier $1: the other VMs never came"; return 1; }
    sleep 0.05
  done
}
now() { date +%s.%N; }
status=0
failed=""
summary=""
tab=$(printf '\t')
while IFS="$tab" read -r name limit cmd; do
  [ -z "$name" ] && continue
  [ "$vms" -gt 1 ] && { barrier "$name" || { status=1; break; }; }
  echo "=== case $name"
  t0=$(now)
  GTEST_OUTPUT="json:$reports/$name/" timeout -k 5 "$limit" sh -c "$cmd"
  rc=$?
  took=$(echo "$(now) $t0" | awk '{printf "%.1f", $1 - $2}')
  [ $rc -eq 124 ] && echo "=== case $name: timed out after $limit s"
  verdict=passed
  [ $rc -ne 0 ] && { verdict="FAILED ($rc)"; [ $status -eq 0 ] && status=$rc; failed="$failed $name"; }
  echo "=== case $name: $verdict in $took s"
  summary="$summary  $(printf '%-28s %-12s %8s s' "$name" "$verdict" "$took")
"
done < "$cases"
[ "$vms" -gt 1 ] && barrier "suite-end"
[ "$RDMAKIT_LAB_INDEX" = 0 ] && { sleep 0.2; rm -rf "$meet"; }
printf '=== suite summary (VM %s)\n%s' "$RDMAKIT_LAB_INDEX" "$summary"
for name in $failed; do
  echo "=== $name: what failed (VM $RDMAKIT_LAB_INDEX)"
  if ls "$reports/$name/"*.json > /dev/null 2>&1; then
    python3 - "$reports/$name/"*.json <<'EOF'
import json, sys
for path in sys.argv[1:]:
    for suite in json.load(open(path)).get("testsuites", []):
        for test in suite.get("testsuite", []):
            for f in test.get("failures", []):
                print(f"  {suite['name']}.{test['name']}:")
                for line in f.get("failure", "").splitlines()[:12]:
                    print(f"    {line}")
EOF
  else
    echo "  (no GoogleTest report: a script, or a test that did not finish; its output is above)"
  fi
done
rm -rf "$reports"
exit $status
