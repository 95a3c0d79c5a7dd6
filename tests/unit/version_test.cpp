// SPDX-License-Identifier: Apache-2.0
#include "rdmakit/version.hpp"

#include <string>

#include <gtest/gtest.h>

// (No std::regex here: under ASan, GCC 12 warns inside <regex> and -Werror stops the build.)
TEST(Version, IsMajorMinorPatch) {
  const std::string v(rdmakit::version());
  int dots = 0;
  bool digit_before = false;
  for (char c : v) {
    if (c == '.') {
      ASSERT_TRUE(digit_before) << v;
      ++dots;
      digit_before = false;
    } else {
      ASSERT_TRUE(c >= '0' && c <= '9') << v;
      digit_before = true;
    }
  }
  EXPECT_EQ(dots, 2) << v;
  EXPECT_TRUE(digit_before) << v;
}
