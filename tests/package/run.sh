#!/usr/bin/env bash
# Installs the built rdmakit into a scratch prefix, then builds and runs a consumer against it
# twice: through find_package(rdmakit) and through pkg-config.
# Usage: run.sh BUILD_DIR SOURCE_DIR SCRATCH_DIR VERSION
set -euo pipefail
build=$1 src=$2 scratch=$3 version=$4
rm -rf "$scratch"
prefix=$scratch/prefix
cmake --install "$build" --prefix "$prefix" > /dev/null

echo "-- find_package(rdmakit)"
cmake -S "$src" -B "$scratch/cmake" -DCMAKE_PREFIX_PATH="$prefix" > /dev/null
cmake --build "$scratch/cmake" > /dev/null
out=$("$scratch/cmake/consumer")
echo "$out"
grep -qx "rdmakit $version" <<< "$out"
grep -q "ibv_reg_mr failed: ENOMEM" <<< "$out"
grep -q "caught from the library: transport failed" <<< "$out"

echo "-- pkg-config rdmakit"
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig:$prefix/lib/x86_64-linux-gnu/pkgconfig
[[ "$(pkg-config --modversion rdmakit)" == "$version" ]]
# A shared librdmakit (RDMAKIT_SHARED_LIBRARY) is installed alone and found at run time through
# the loader's path; a static one brings its private dependencies (--static).
libdir=$(pkg-config --variable=libdir rdmakit)
static=--static
[[ ! -e "$libdir/librdmakit.so" ]] || static=
# shellcheck disable=SC2046,SC2086  # word splitting of the flags is intended
c++ -std=c++20 "$src/consumer.cpp" -o "$scratch/consumer-pc" $(pkg-config --cflags --libs $static rdmakit)
out=$(LD_LIBRARY_PATH=$libdir "$scratch/consumer-pc")
grep -qx "rdmakit $version" <<< "$out"
echo "package consumer: ok"

# The Python package, where the build made one: importable from the prefix it was installed to.
if [[ -e "$build/python/rdmakit/__init__.py" ]]; then
  init=$(find "$prefix" -path '*/rdmakit/__init__.py' | head -n 1)
  [[ -n "$init" ]] || { echo "the Python package was built but not installed" >&2; exit 1; }
  echo "-- import rdmakit from $(dirname "$(dirname "$init")")"
  # A module linking the shared library finds it through its RUNPATH where it was installed
  # outside the loader's directories; one installed for /usr (CI's tree) has none, and is
  # shown the prefix's library directory as the system's would be.
  module=$(find "$(dirname "$init")" -name '_rdmakit*.so' | head -n 1)
  loader=()
  if readelf -d "$module" | grep -q 'NEEDED.*librdmakit' && ! readelf -d "$module" | grep -q RUNPATH; then
    loader=(env LD_LIBRARY_PATH="$libdir")
  fi
  (cd / && PYTHONPATH=$(dirname "$(dirname "$init")") "${loader[@]}" /usr/bin/python3 -c \
    "import rdmakit; assert rdmakit.__version__ == '$version'; print('python package: ok')")
fi
