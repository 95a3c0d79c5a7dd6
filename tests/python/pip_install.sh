#!/bin/sh
# `pip install .` from the source tree into a fresh venv that sees Debian's packages (numpy,
# torch, pytest), offline, then checks the installed package from outside the tree. The lab's
# Python cases and unit.python run with this venv's interpreter, so they test what pip installed.
# Then the CMake install of the same build (the component `python`, as `cmake --install` puts it
# under a prefix) into SCRATCH, imported from there with the plain interpreter.
# Usage: pip_install.sh PYTHON SOURCE_DIR VENV SCRATCH [CMAKE_ARG...]
# The CMake arguments go to the package's CMake build (setup.py's RDMAKIT_CMAKE_ARGS): the
# enclosing build's compiler launcher and warning flags, so that with ccache the library's
# objects come from that build's (scripts/test), and no link-time optimisation (its serial
# link costs CI time and nothing here is timed).
set -eu
py=$1 src=$2 venv=$3 scratch=$4
shift 4
rm -rf "$venv" "$scratch"
"$py" -m venv --system-site-packages "$venv"
RDMAKIT_CMAKE_ARGS="$*" \
  "$venv/bin/pip" install --no-build-isolation --no-index --quiet --disable-pip-version-check "$src"
cd /
"$venv/bin/python" - <<'PY'
import importlib.metadata, sys
import rdmakit
assert rdmakit.__file__.startswith(sys.prefix), rdmakit.__file__
assert importlib.metadata.version("rdmakit") == rdmakit.__version__
print("pip installed rdmakit", rdmakit.__version__, "at", rdmakit.__file__)
PY
cmake_dir=$(ls -d "$src"/build/pip/temp*/cmake | head -n 1)
cmake --install "$cmake_dir" --component python --prefix "$scratch" > /dev/null
init=$(find "$scratch" -path '*/rdmakit/__init__.py' | head -n 1)
[ -n "$init" ] || { echo "cmake --install put no rdmakit package under $scratch" >&2; exit 1; }
site=$(dirname "$(dirname "$init")")
PYTHONPATH=$site "$py" -c "import rdmakit; assert rdmakit.__file__.startswith('$site'); print('cmake --install: rdmakit', rdmakit.__version__, 'at', rdmakit.__file__)"
