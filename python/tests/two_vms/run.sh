#!/bin/sh
# The Python two-VM case: the pytest initiator on VM 0, target.py on VM 1 (tests/rxe suite).
# The initiator imports torch: VM 0 did already in the case before (python.pytest), so torch's
# files are in its page cache; on VM 1 the import read them over 9p first (about 30 s of a
# TCG guest's time).
# Usage: run.sh PYTHON
set -u
PY=$1
here=$(dirname "$0")
set -- $RDMAKIT_LAB_IPS
if [ "$RDMAKIT_LAB_INDEX" = 1 ]; then
  exec "$PY" "$here/target.py" 7650
else
  RDMAKIT_TEST_PEER="$2:7650" exec "$PY" -m pytest -q -p no:cacheprovider "$here/test_two_vms.py"
fi
