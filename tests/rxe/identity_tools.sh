#!/bin/sh
# Identities and access from the command line, in one lab VM: `rdmakit keygen --identity` writes
# a key pair (secret 0600, public key in FILE.pub); `rdmakit serve --identity --allow --commands`
# prints its public key, serves the client it allows and refuses others; `engine-bench
# --peer-key` links only to the holder of that key; "revoke client" on serve's standard input
# cuts the client off with a reason it prints, and "allow client" lets it back.
#   identity_tools.sh PATH_TO_rdmakit
set -u
R=$1
d=$(mktemp -d /tmp/identity-tools.XXXXXX)
pids=""
cleanup() { exec 3>&- 2>/dev/null; kill $pids 2>/dev/null; wait 2>/dev/null; rm -rf "$d"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; [ -e "$d/serve.out" ] && { echo "== serve"; cat "$d/serve.out"; }; exit 1; }
# Waits until serve has answered a command of `$1` on its standard input.
took() {
  i=0
  until grep -q "\"command\":\"$1\"" "$d/serve.out"; do
    i=$((i + 1)); [ $i -gt 100 ] && fail "serve did not take the $1 command"
    sleep 0.1
  done
}
bench() { "$R" engine-bench --psk-file "$d/psk" --peer t=127.0.0.1:7650 --op write --block-size 4K --batch-size 8 \
  --duration 0.3 --validate --timeout 5000 "$@" 2>&1; }

"$R" keygen "$d/psk" > /dev/null || fail "keygen"
out=$("$R" keygen --identity "$d/t.id") || fail "keygen --identity: $out"
echo "$out"
key=$(cat "$d/t.id.pub")
case "$key" in ed25519:*) ;; *) fail "t.id.pub holds '$key'" ;; esac
echo "$out" | grep -q "$key" || fail "keygen --identity does not print the public key"
[ "$(stat -c %a "$d/t.id")" = 600 ] || fail "the identity file is mode $(stat -c %a "$d/t.id")"
"$R" keygen --identity "$d/t.id" > /dev/null 2>&1 && fail "keygen overwrote an identity"
"$R" keygen --identity "$d/other.id" > /dev/null || fail "keygen --identity other"
other=$(cat "$d/other.id.pub")

mkfifo "$d/commands"
"$R" serve --name t --psk-file "$d/psk" --identity "$d/t.id" --allow client --commands --listen 7650 \
  --expose kv:1M --json < "$d/commands" > "$d/serve.out" 2>&1 &
pids="$pids $!"
exec 3> "$d/commands"
i=0
until grep -q '"event":"serving"' "$d/serve.out" 2>/dev/null; do
  i=$((i + 1)); [ $i -gt 300 ] && fail "serve never served"
  sleep 0.1
done
grep '"event":"serving"' "$d/serve.out" | grep -q "\"public_key\":\"$key\"" || fail "serve does not print its key"

out=$(bench --name client --peer-key "t=$key") || fail "the allowed client with t's key: $out"
echo "$out" | grep -q "validated: every byte" || fail "not validated: $out"
out=$(bench --name client --peer-key "t=$other") && fail "a link to t passed for another key"
echo "$out" | grep -q "where its key $other (given to add_peer) was expected" || fail "the mismatch is not named: $out"
out=$(bench --name stranger) && fail "a peer serve does not --allow linked"
echo "$out" | grep -q "is not among the peers engine 't' allows" || fail "the refusal does not say why: $out"
echo "revoke client" >&3
took revoke
out=$(bench --name client) && fail "a revoked client linked"
echo "$out" | grep -q "is revoked by engine 't'" || fail "the revocation is not the reason: $out"
echo "allow client" >&3
took allow
out=$(bench --name client --peer-key "t=$key") || fail "the client allowed again: $out"
echo "bad command" >&3
sleep 0.3
grep -q '"ok":false' "$d/serve.out" || fail "an unknown command was not refused"
echo "identity tools: ok"
