#!/bin/sh
# The CLI's help says what the commands do (issue 38): `doctor --help` does not offer --connect
# (it always failed: the doctor checks a peer with --peer), and `peers` asks for the store it
# lists instead of defaulting to p2p and then refusing it. Usage: cli_help.sh PATH_TO_RDMAKIT
R=$1
"$R" doctor --help | grep -q -- "--connect" && { echo "FAIL: doctor --help lists --connect"; exit 1; }
"$R" doctor --help | grep -q -- "--peer" || { echo "FAIL: doctor --help lacks --peer"; exit 1; }
out=$("$R" peers 2>&1) && { echo "FAIL: rdmakit peers without --metadata exited 0: $out"; exit 1; }
echo "$out" | grep -q -- "--metadata is required" || { echo "FAIL: rdmakit peers said: $out"; exit 1; }
"$R" peers --help | grep -q "=p2p" && { echo "FAIL: peers --help still defaults to p2p"; exit 1; }
out=$("$R" peers --metadata p2p 2>&1) && { echo "FAIL: rdmakit peers --metadata p2p exited 0"; exit 1; }
echo "$out" | grep -q "lists a store's engines" || { echo "FAIL: rdmakit peers --metadata p2p said: $out"; exit 1; }
echo "PASS: doctor and peers say what they take"
