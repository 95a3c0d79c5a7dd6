# SPDX-License-Identifier: Apache-2.0
"""Builds rdmakit's extension module with the project's own CMake (the library and the module
only: no tools, tests or benchmarks), so `pip install .` and `cmake --build` make the same thing.
Metadata lives in pyproject.toml."""
import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent
# setuptools' own scratch directories, kept out of the source tree (build/ is CMake's).
SCRATCH = ROOT / "build" / "pip"
SCRATCH.mkdir(parents=True, exist_ok=True)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out = pathlib.Path(self.get_ext_fullpath(ext.name)).resolve()
        build = pathlib.Path(self.build_temp).resolve() / "cmake"
        config = [
            "-DCMAKE_BUILD_TYPE=Release",
            "-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG",  # as fast here as -O3, and compiles faster
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DRDMAKIT_BUILD_PYTHON=ON",
            "-DRDMAKIT_BUILD_TOOLS=OFF",
            "-DRDMAKIT_BUILD_TESTS=OFF",
            "-DRDMAKIT_BUILD_BENCH=OFF",
        ]
        config += os.environ.get("RDMAKIT_CMAKE_ARGS", "").split()
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), *generator, *config],
                       check=True)
        jobs = str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", str(build), "--target", "rdmakit_python", "-j", jobs],
                       check=True)
        built = next((build / "python" / "rdmakit").glob("_rdmakit*.so"))
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, out)


setup(
    ext_modules=[CMakeExtension("rdmakit._rdmakit")],
    cmdclass={"build_ext": CMakeBuild},
    options={"build": {"build_base": str(SCRATCH)}, "egg_info": {"egg_base": str(SCRATCH)}},
)
