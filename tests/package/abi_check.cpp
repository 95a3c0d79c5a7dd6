// SPDX-License-Identifier: Apache-2.0
// Nothing of its own: rdmakit_abi_check is the library's objects linked as a shared object with
// its version script (tests/CMakeLists.txt), for abi_exports.sh to read its exports.
