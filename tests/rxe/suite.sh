#!/bin/sh
# Runs the cases of one rxe suite inside one lab boot, one after another, so many cases share a
# boot. CASES_FILE has a line per case: NAME, a tab, TIMEOUT in seconds, a tab, the command. Every
# case runs even when an earlier one failed; a summary with each case's wall time ends the
# output, and the exit status is that of the first failure (0 if none).
# With several VMs, every VM runs every case, and all meet at a barrier before each case (files
# in the shared working directory, named by the lab run's id).
#   suite.sh CASES_FILE
set -u
cases=$1
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
summary=""
tab=$(printf '\t')
while IFS="$tab" read -r name limit cmd; do
  [ -z "$name" ] && continue
  [ "$vms" -gt 1 ] && { barrier "$name" || { status=1; break; }; }
  echo "=== case $name"
  t0=$(now)
  timeout -k 5 "$limit" sh -c "$cmd"
  rc=$?
  took=$(echo "$(now) $t0" | awk '{printf "%.1f", $1 - $2}')
  [ $rc -eq 124 ] && echo "=== case $name: timed out after $limit s"
  verdict=passed
  [ $rc -ne 0 ] && { verdict="FAILED ($rc)"; [ $status -eq 0 ] && status=$rc; }
  echo "=== case $name: $verdict in $took s"
  summary="$summary  $(printf '%-28s %-12s %8s s' "$name" "$verdict" "$took")
"
done < "$cases"
[ "$vms" -gt 1 ] && barrier "suite-end"
[ "$RDMAKIT_LAB_INDEX" = 0 ] && { sleep 0.2; rm -rf "$meet"; }
printf '=== suite summary (VM %s)\n%s' "$RDMAKIT_LAB_INDEX" "$summary"
exit $status
