# SPDX-License-Identifier: Apache-2.0
# Initial cache (cmake -C) of a build that is installed as Debian's packages are: the shared
# library beside the static one (the tool and the Python module link the shared one), the
# Python module for Debian's /usr/bin/python3, installed under /usr (GNUInstallDirs then picks
# the multiarch library directory; the module goes to lib/python3/dist-packages). debian/rules
# configures with it; CI's plain build does too, and its tree is what CI packages.
# What the packages' test and debian/rules check for. An initial cache does not replace entries a
# tree has already: the top-level CMakeLists.txt stops a tree configured before with other ones.
set(RDMAKIT_PACKAGE_BUILD ON CACHE BOOL "Configured with cmake/package.cmake")
set(CMAKE_INSTALL_PREFIX /usr CACHE PATH "")
set(CMAKE_POSITION_INDEPENDENT_CODE ON CACHE BOOL "")
set(RDMAKIT_SHARED_LIBRARY ON CACHE BOOL "")
set(RDMAKIT_BUILD_TOOLS ON CACHE BOOL "")
set(RDMAKIT_BUILD_PYTHON ON CACHE BOOL "")
set(Python3_EXECUTABLE /usr/bin/python3 CACHE FILEPATH "")
