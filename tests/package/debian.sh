#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Debian packages as a user gets them: built from this build tree (scripts/build-debs
# --from: the tree is configured with -C cmake/package.cmake), checked by lintian, installed
# with apt into a clean Debian 12 root made by mmdebstrap from Debian's archive (their
# dependencies come from there, nothing from this host), and there: a find_package consumer and
# a pkg-config consumer build and run rdmakit::version(), python3 imports rdmakit, and
# `rdmakit hello` runs between two lab VMs whose root is that one, with the packaged
# rdmakit-lab. Root only (mmdebstrap's root mode, chroot).
# Usage: debian.sh BUILD_DIR SOURCE_DIR SCRATCH_DIR VERSION [root|lab|clean]
#   root   the packages built, installed into the root and used there; the root stays in
#          SCRATCH_DIR (no VM: CTest runs it beside the other tests without one)
#   lab    the two lab VMs running the root that `root` left
#   clean  the root (580 MB) removed (CTest's fixture cleanup, whatever ran before)
#   (none: all three in turn)
set -euo pipefail
build=$1 src=$2 scratch=$3 version=$4 part=${5:-all}
case "$part" in root|lab|clean|all) ;; *) echo "debian.sh: unknown part '$part' (root, lab, clean)" >&2; exit 2 ;; esac
if [[ $(id -u) -ne 0 ]]; then echo "SKIP: needs root (mmdebstrap, chroot)"; exit 77; fi
t0=$SECONDS
step() { printf -- '-- %s (%d s)\n' "$1" $((SECONDS - t0)); }
root=$scratch/root
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
# mmdebstrap mounts /proc, /sys and /dev in the root while it installs; one killed (the test's
# timeout) may leave them: unmount before removing, and never cross into another file system.
remove_root() {
  local r
  r=$(realpath -m "$root")
  findmnt -rn -o TARGET | awk -v r="$r/" 'index($0, r) == 1' | sort -r | xargs -r -n 1 umount -l || true
  rm -rf --one-file-system "$root"
}
make_root() {
  remove_root
  rm -rf --one-file-system "$scratch"
  mkdir -p "$scratch"

  step "build the packages from $build, lintian"
  "$src/scripts/build-debs" --from "$build" "$scratch/debs"

  step "a clean Debian 12 root with the packages (mmdebstrap)"
  includes=() packages=()
  for d in "$scratch"/debs/*.deb; do
    includes+=(--include="$d")
    packages+=("$(dpkg-deb -f "$d" Package)")
  done
  # The consumers' tools, and what the lab's guests run (iproute2; rxe's provider).
  mmdebstrap --quiet --variant=apt --include=g++,cmake,make,pkgconf,iproute2,ibverbs-providers \
    --hook-dir=/usr/share/mmdebstrap/hooks/file-mirror-automount "${includes[@]}" bookworm "$root" > "$scratch/mmdebstrap.log" 2>&1 \
    || { cat "$scratch/mmdebstrap.log"; exit 1; }
  for p in "${packages[@]}"; do
    [[ "$(chroot "$root" dpkg-query -W -f='${Version}' "$p")" == "$version" ]] \
      || { echo "FAIL: $p $version is not installed in the root"; exit 1; }
  done
  # Nothing of this host's build went in: the library is the package's, found by the loader.
  # (Captured first: grep -q leaves at its match, and a writer still writing would fail the pipe.)
  loads=$(chroot "$root" ldd /usr/bin/rdmakit)
  grep -qE "librdmakit.so.0.1 => (/usr)?/lib/$multiarch/" <<< "$loads" \
    || { echo "FAIL: /usr/bin/rdmakit does not load the packaged librdmakit:"; echo "$loads"; exit 1; }

  step "consumers in the root: find_package, pkg-config, python3"
  mkdir -p "$root/opt/consumer"
  cp "$src/tests/package/consumer.cpp" "$src/tests/package/CMakeLists.txt" "$root/opt/consumer/"
  chroot "$root" bash -euo pipefail -c "
    cd /opt/consumer
    cmake -S . -B cmake-build > /dev/null
    cmake --build cmake-build > /dev/null
    ./cmake-build/consumer > find_package.out
    cat find_package.out
    grep -qx 'rdmakit $version' find_package.out
    grep -q 'caught from the library: transport failed' find_package.out
    c++ -std=c++20 consumer.cpp -o consumer-pc \$(pkg-config --cflags --libs rdmakit)
    ./consumer-pc > pkg-config.out
    grep -qx 'rdmakit $version' pkg-config.out
    echo 'pkg-config consumer: rdmakit $version'
    cd / && python3 -c 'import rdmakit; assert rdmakit.__version__ == \"$version\", rdmakit.__version__; print(\"python3: import rdmakit\", rdmakit.__version__)'
    test \"\$(rdmakit --version)\" = '$version'
    man -w rdmakit-lab > /dev/null 2>&1 || test -e /usr/share/man/man1/rdmakit-lab.1.gz
  "
}

use_in_lab() {
  step "rdmakit hello between two lab VMs running the root (the packaged rdmakit-lab)"
  mkdir -p "$scratch/lab"
  cp "$src/tests/rxe/hello.sh" "$scratch/lab/"
  cd "$scratch/lab"
  /usr/bin/python3 "$root/usr/bin/rdmakit-lab" run --vms 2 --root "$root" --timeout 120 -- \
    sh ./hello.sh two_vms /usr/bin/rdmakit
}

case "$part" in
  root) make_root; step "done: packages built, installed into a clean root ($root) and used there" ;;
  lab)
    [[ -x $root/usr/bin/rdmakit ]] || { echo "FAIL: no root with the packages at $root (debian.sh ... root makes it)"; exit 1; }
    use_in_lab; step "done: the packaged rdmakit between two lab VMs" ;;
  clean) remove_root ;;
  all) make_root; use_in_lab; remove_root; step "done: packages built, installed into a clean root, and used" ;;
esac
