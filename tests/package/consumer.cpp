// SPDX-License-Identifier: Apache-2.0
// Uses the installed headers and library: prints the version, formats an rdmakit::Error, and
// catches one the library throws (its typeinfo must cross from the library to this program).
#include <cerrno>
#include <iostream>

#include <rdmakit/engine.hpp>
#include <rdmakit/error.hpp>
#include <rdmakit/version.hpp>

int main() {
  std::cout << "rdmakit " << rdmakit::version() << "\n";
  try {
    throw rdmakit::Error("ibv_reg_mr", ENOMEM, "consumer test");
  } catch (const rdmakit::Error& e) {
    std::cout << e.what() << "\n";
    if (e.sys_errno() != ENOMEM) return 1;
  }
  try {
    (void)rdmakit::parse_transport("carrier pigeon");
    std::cout << "parse_transport accepted a carrier pigeon\n";
    return 1;
  } catch (const rdmakit::Error& e) {
    std::cout << "caught from the library: " << e.what() << "\n";
    return e.sys_errno() == EINVAL ? 0 : 1;
  }
}
