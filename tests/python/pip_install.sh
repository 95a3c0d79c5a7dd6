#!/bin/sh
# `pip install .` from the source tree into a fresh venv that sees Debian's packages (numpy,
# torch, pytest), offline, then checks the installed package from outside the tree. The lab's
# Python cases run with this venv's interpreter, so they test what pip installed.
# Usage: pip_install.sh PYTHON SOURCE_DIR VENV
set -eu
py=$1 src=$2 venv=$3
rm -rf "$venv"
"$py" -m venv --system-site-packages "$venv"
"$venv/bin/pip" install --no-build-isolation --no-index --quiet --disable-pip-version-check "$src"
cd /
"$venv/bin/python" - <<'PY'
import importlib.metadata, sys
import rdmakit
assert rdmakit.__file__.startswith(sys.prefix), rdmakit.__file__
assert importlib.metadata.version("rdmakit") == rdmakit.__version__
print("pip installed rdmakit", rdmakit.__version__, "at", rdmakit.__file__)
PY
