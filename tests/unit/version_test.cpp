#include "rdmakit/version.hpp"

#include <regex>
#include <string>

#include <gtest/gtest.h>

TEST(Version, IsSemanticVersion) {
  const std::string v(rdmakit::version());
  EXPECT_TRUE(std::regex_match(v, std::regex(R"(\d+\.\d+\.\d+)"))) << v;
}
