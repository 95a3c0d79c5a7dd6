// SPDX-License-Identifier: Apache-2.0
// promtool (Debian's prometheus package; scripts/install-deps installs it) on a file the test
// writes: the exposition text's and the dashboard's checks, in the unit and the engine tests.
#pragma once

#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <unistd.h>

namespace rdmakit::testing_support {

/// Runs `promtool <command> <file>` on `content` written to a temporary file named `name` (and
/// this process's id: test processes run side by side): empty when it passes, else what
/// promtool said (a missing promtool fails too).
inline std::string promtool(const std::string& command, const std::string& content, const std::string& name) {
  const std::string path = ::testing::TempDir() + std::to_string(::getpid()) + "." + name;
  std::ofstream(path) << content;
  const std::string redirect = command == "check metrics" ? " < " : " ";
  FILE* p = ::popen(("promtool " + command + redirect + path + " 2>&1; echo rc=$?").c_str(), "r");
  if (p == nullptr) return "popen failed";
  std::string out;
  char line[512];
  while (std::fgets(line, sizeof line, p) != nullptr) out += line;
  ::pclose(p);
  std::remove(path.c_str());
  return out.find("rc=0") != std::string::npos ? std::string{} : out;
}

}  // namespace rdmakit::testing_support
