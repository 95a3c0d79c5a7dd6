#!/bin/sh
# The Python two-VM case: target.py on VM 0, the pytest initiator on VM 1 (tests/rxe suite).
# Usage: run.sh PYTHON
set -u
PY=$1
here=$(dirname "$0")
set -- $RDMAKIT_LAB_IPS
if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
  exec "$PY" "$here/target.py" 7650
else
  RDMAKIT_TEST_PEER="$1:7650" exec "$PY" -m pytest -q -p no:cacheprovider "$here/test_two_vms.py"
fi
