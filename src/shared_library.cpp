// SPDX-License-Identifier: Apache-2.0
// Nothing of its own: librdmakit.so is the static library's objects linked whole as a shared
// object with the version script rdmakit.map (src/CMakeLists.txt, RDMAKIT_SHARED_LIBRARY).
