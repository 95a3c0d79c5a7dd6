#!/bin/sh
# rdmakit hello inside the lab. Usage: hello.sh one_vm|two_vms|many_clients PATH_TO_RDMAKIT
# Output goes to the guest's private /tmp; each check prints what it looked at when it fails.
set -u
mode=$1
R=$2
out=/tmp/hello.$$
mkdir -p "$out"
fail() { echo "FAIL: $*"; for f in "$out"/*; do echo "--- $f"; cat "$f"; done; exit 1; }
expect() { grep -qF -- "$2" "$1" || fail "$1 lacks: $2"; }

# The client retries a refused connect until its --timeout (the server starts at the same time).
client() {  # client NAME ARGS...
  name=$1; shift
  "$R" hello "$@" > "$out/$name" 2>&1
}

check_negotiated() {  # the parameters both sides must print
  expect "$1" "device      $RDMAKIT_LAB_DEVICE port 1 (Ethernet)"
  # Over loopback no GID has the socket's address: the priority order. Across VMs, the GID of the
  # bootstrap connection's own address (the route to the peer).
  if [ "$mode" = two_vms ]; then
    expect "$1" "::ffff:$RDMAKIT_LAB_IP RoCE v2 (the local address of the route to the peer, $RDMAKIT_LAB_IP (RoCE v2))"
  else
    expect "$1" "RoCE v2 (RoCE v2 with an IPv4 address (first priority); no GID has the route's local address 127.0.0.1)"
  fi
  expect "$1" "path MTU    1024 (local active 1024, remote active 1024)"
  expect "$1" "remote QP   QPN 0x"
}

case $mode in
one_vm)
  "$R" hello --listen 127.0.0.1:12025 > "$out/server" 2>&1 &
  server=$!
  client client --connect 127.0.0.1 --message "Hello from one VM" || fail "client failed"
  wait $server || fail "server exited $?"
  expect "$out/server" 'received: "Hello from one VM"'
  expect "$out/server" 'read back: "Hello from one VM"'
  expect "$out/client" 'server read back: "Hello from one VM"'
  check_negotiated "$out/server"
  check_negotiated "$out/client"
  expect "$out/server" "without a pre-shared key, on 127.0.0.1 only: any process of this host"
  # With a key file on both sides it works; a client with another key is refused, and says why.
  # rdmakit keygen writes one (mode 0600); any file of raw bytes with that mode is one too.
  "$R" keygen "$out/key" > "$out/keygen" 2>&1 || fail "keygen exited $?"
  expect "$out/keygen" "wrote a 32-byte key to $out/key (mode 0600)"
  [ "$(stat -c %a "$out/key")" = 600 ] || fail "keygen: mode $(stat -c %a "$out/key")"
  "$R" keygen "$out/key" > "$out/keygen-again" 2>&1 && fail "keygen overwrote a key"
  expect "$out/keygen-again" "exists already"
  head -c 32 /dev/urandom > "$out/other" && chmod 600 "$out/other"
  "$R" hello --listen 127.0.0.1:12030 --psk-file "$out/key" > "$out/server-psk" 2>&1 &
  server=$!
  client client-wrong --connect 127.0.0.1:12030 --psk-file "$out/other" && fail "a wrong key connected"
  expect "$out/client-wrong" "failed to prove it knows the pre-shared key"
  client client-psk --connect 127.0.0.1:12030 --psk-file "$out/key" --message "keyed" || fail "keyed client failed"
  wait $server || fail "keyed server exited $?"
  expect "$out/server-psk" 'received: "keyed"'
  # Other memory: huge pages, and a vgem dma-buf through the bounce path, on both sides.
  for mem in hugepage dmabuf; do
    "$R" hello --listen 127.0.0.1:12031 --mem $mem > "$out/server-$mem" 2>&1 &
    server=$!
    client "client-$mem" --connect 127.0.0.1:12031 --mem $mem --message "through $mem" || fail "--mem $mem client failed"
    wait $server || fail "--mem $mem server exited $?"
    expect "$out/server-$mem" "received: \"through $mem\""
    expect "$out/client-$mem" "server read back: \"through $mem\""
    expect "$out/client-$mem" "memory      $mem memory"
  done
  expect "$out/client-dmabuf" "ibv_reg_dmabuf_mr: EOPNOTSUPP (the device cannot register dma-buf MRs); fell back to a bounce buffer"
  cat "$out/server" "$out/client"
  ;;
two_vms)
  set -- $RDMAKIT_LAB_IPS
  if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then
    "$R" hello --listen > "$out/server" 2>&1 || fail "server exited $?"
    expect "$out/server" "peer        $2:"
    expect "$out/server" 'received: "Hello,World"'
    expect "$out/server" 'read back: "Hello,World"'
    expect "$out/server" "remote GID  [1] ::ffff:$2 RoCE v2"
    check_negotiated "$out/server"
    cat "$out/server"
  else
    client client --connect "$1" || fail "client failed"
    expect "$out/client" 'server read back: "Hello,World"'
    expect "$out/client" "remote GID  [1] ::ffff:$1 RoCE v2"
    check_negotiated "$out/client"
    cat "$out/client"
  fi
  ;;
many_clients)
  n=16
  "$R" hello --listen 127.0.0.1:12025 --serve > "$out/server" 2>&1 &
  server=$!
  pids=""
  for i in $(seq $n); do
    client "client$i" --connect 127.0.0.1 --message "client $i of $n" &
    pids="$pids $!"
  done
  failed=0
  for p in $pids; do wait "$p" || failed=$((failed + 1)); done
  [ $failed -eq 0 ] || fail "$failed of $n clients failed"
  for i in $(seq $n); do
    expect "$out/client$i" "server read back: \"client $i of $n\""
    expect "$out/server" "read back: \"client $i of $n\""
  done
  kill "$server"
  [ "$(grep -c 'received: ' "$out/server")" -eq $n ] || fail "the server did not receive exactly $n messages"
  echo "all $n clients verified"
  ;;
*)
  fail "unknown mode $mode"
  ;;
esac
echo "PASS: hello $mode"
