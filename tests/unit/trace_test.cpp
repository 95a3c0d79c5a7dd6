// SPDX-License-Identifier: Apache-2.0
#include <string>

#include <gtest/gtest.h>

#include "rdmakit/connection.hpp"

namespace {

TEST(Trace, TextQuotesValuesWithSpaces) {
  const rdmakit::TraceEvent e{"qp_transition", {{"qp", "0x11"}, {"path_mtu", "1024 (local active 1024)"}, {"empty", ""}}};
  EXPECT_EQ(e.text(), "qp_transition qp=0x11 path_mtu=\"1024 (local active 1024)\" empty=\"\"");
}

TEST(Trace, JsonKeepsFieldOrderAndEscapes) {
  const rdmakit::TraceEvent e{"handshake_failed", {{"peer", "[::1]:5"}, {"error", "line1\nsaid \"no\""}}};
  EXPECT_EQ(e.json(), R"({"event":"handshake_failed","peer":"[::1]:5","error":"line1\nsaid \"no\""})");
}

}  // namespace
