#!/bin/sh
# The README's example across two lab VMs. Usage: example.sh PATH_TO_write_and_read
set -u
X=$1
set -- $RDMAKIT_LAB_IPS
if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
  out=$("$X" --listen 7471) || { echo "FAIL: server exited $?"; exit 1; }
  echo "$out"
  [ "$out" = "received: hello over RDMA" ] || { echo "FAIL: unexpected server output"; exit 1; }
else
  # The example client does not retry a refused connect; the server starts at the same moment.
  for i in $(seq 50); do "$X" "$1:7471" 2>/dev/null && exit 0; sleep 0.2; done
  echo "FAIL: the client never succeeded"; "$X" "$1:7471"; exit 1
fi
