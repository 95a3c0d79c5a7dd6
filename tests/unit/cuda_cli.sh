#!/bin/sh
# Without a GPU, `rdmakit hello --mem cuda` and `bench --mem cuda-host` must say "no CUDA device"
# and exit non-zero, before trying to connect. Usage: cuda_cli.sh PATH_TO_RDMAKIT
R=$1
if [ -e /proc/driver/nvidia/gpus ] && [ -n "$(ls /proc/driver/nvidia/gpus 2>/dev/null)" ]; then
  echo "SKIP: an NVIDIA GPU is present"; exit 0
fi
for args in "hello --connect 127.0.0.1:9 --mem cuda" "bench write bw --connect 127.0.0.1:9 --mem cuda-host"; do
  out=$("$R" $args 2>&1)
  rc=$?
  [ $rc -ne 0 ] || { echo "FAIL: rdmakit $args exited 0"; exit 1; }
  echo "$out" | grep -q "no CUDA device" || { echo "FAIL: rdmakit $args said: $out"; exit 1; }
done
echo "PASS: no CUDA device said, exit non-zero"
