#!/bin/sh
# Runs COMMAND on every CPU of the host. CI runs ctest held off the lab's CPU (scripts/test,
# RDMAKIT_LAB_CPU); a test whose point is threads on two cores at once runs alone (RUN_SERIAL)
# and takes every CPU back through this. (taskset intersects the list with the CPUs there are.)
#   all_cpus.sh COMMAND [ARGS...]
exec taskset -c "0-$(($(getconf _NPROCESSORS_CONF) - 1))" "$@"
