// SPDX-License-Identifier: Apache-2.0
// Uses the installed headers and library: prints the version and formats an rdmakit::Error.
#include <cerrno>
#include <iostream>

#include <rdmakit/error.hpp>
#include <rdmakit/version.hpp>

int main() {
  std::cout << "rdmakit " << rdmakit::version() << "\n";
  try {
    throw rdmakit::Error("ibv_reg_mr", ENOMEM, "consumer test");
  } catch (const rdmakit::Error& e) {
    std::cout << e.what() << "\n";
    return e.sys_errno() == ENOMEM ? 0 : 1;
  }
}
