#!/bin/sh
# Runs a command on every VM of a lab with a Redis server and an etcd member running on VM 0,
# reachable from every VM: RDMAKIT_VMS_STORES names them ("redis://IP:6399 etcd://IP:2399").
# VM 0 stops them when its command has ended (by then the others' engines have told it they are
# done with it).
#   with_stores.sh COMMAND [ARGS...]
set -u
set -- "$@"
ips=$RDMAKIT_LAB_IPS
ip0=${ips%% *}
export RDMAKIT_VMS_STORES="redis://$ip0:6399 etcd://$ip0:2399"
if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
  data=$(mktemp -d /tmp/stores.XXXXXX)
  redis-server --port 6399 --bind 0.0.0.0 --protected-mode no --save '' --appendonly no --dir "$data" \
    > "$data/redis.log" 2>&1 &
  redis=$!
  etcd --name vms --data-dir "$data/etcd" --listen-client-urls "http://0.0.0.0:2399" \
    --advertise-client-urls "http://$ip0:2399" --listen-peer-urls http://127.0.0.1:2398 \
    --initial-advertise-peer-urls http://127.0.0.1:2398 --initial-cluster vms=http://127.0.0.1:2398 \
    > "$data/etcd.log" 2>&1 &
  etcd=$!
  "$@"
  rc=$?
  kill $redis $etcd 2>/dev/null
  wait $redis $etcd 2>/dev/null
  [ $rc = 0 ] || { echo "== redis log"; tail -20 "$data/redis.log"; echo "== etcd log"; tail -20 "$data/etcd.log"; }
  rm -rf "$data"
  exit $rc
fi
exec "$@"
