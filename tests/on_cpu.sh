#!/bin/sh
# Runs COMMAND held to the host CPU that ctest gave the test: a test registered with
# RESOURCE_GROUPS "cpus:1" (cmake/rdmakitLab.cmake, RDMAKIT_TEST_CPUS) and run by a ctest given a
# resource spec file that lists the host's CPUs (scripts/test). A lab run under it holds its VM
# there, at one vCPU (RDMAKIT_LAB_CPUS). A ctest run without the spec file allots nothing: the
# test then fails, saying so (the one-VM suites would share cores with each other and every test).
#   on_cpu.sh [--own-network] COMMAND [ARGS...]
# --own-network: in a network namespace of its own with only loopback (unshare: root), so that
# the fixed ports its peer processes listen on clash with no other test's.
own_network=false
if [ "${1:-}" = --own-network ]; then
  own_network=true
  shift
fi
# ctest's allocation: "id:N,slots:1".
group=${CTEST_RESOURCE_GROUP_0_CPUS-}
cpu=
if [ -n "$group" ]; then
  case "$group" in
    *\;*) ;;  # more than one CPU: not what these tests ask for
    id:*,slots:*) cpu=${group#id:}; cpu=${cpu%%,*} ;;
  esac
  case "$cpu" in
    '' | *[!0-9]*) echo "on_cpu.sh: ctest's CPU allocation is not id:N,slots:M: '$group'" >&2; exit 1 ;;
  esac
  export RDMAKIT_LAB_CPUS="$cpu"
  set -- taskset -c "$cpu" "$@"
else
  echo "on_cpu.sh: ctest allotted no CPU: run it with --resource-spec-file (scripts/test writes BUILD/cpus.json;" \
    "docs/development.md), or configure with -DRDMAKIT_TEST_CPUS=OFF" >&2
  exit 1
fi
if $own_network; then
  exec unshare --net sh -c 'ip link set lo up || { echo "on_cpu.sh: no loopback in a new network namespace" >&2; exit 1; }; exec "$@"' on_cpu "$@"
fi
exec "$@"
