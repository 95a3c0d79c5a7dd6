// SPDX-License-Identifier: Apache-2.0
#include "rdmakit/error.hpp"

#include <cerrno>
#include <string>

#include <gtest/gtest.h>

namespace {

TEST(Error, MessageNamesVerbErrnoDetailAndHint) {
  const rdmakit::Error e("ibv_modify_qp(INIT->RTR)", EINVAL, "dest_qp_num=0x1000000",
                         "the peer's QPN does not fit in 24 bits");
  const std::string what = e.what();
  EXPECT_EQ(e.op(), "ibv_modify_qp(INIT->RTR)");
  EXPECT_EQ(e.sys_errno(), EINVAL);
  EXPECT_EQ(e.detail(), "dest_qp_num=0x1000000");
  EXPECT_EQ(e.hint(), "the peer's QPN does not fit in 24 bits");
  EXPECT_EQ(what,
            "ibv_modify_qp(INIT->RTR) failed: EINVAL (Invalid argument): dest_qp_num=0x1000000. "
            "Hint: the peer's QPN does not fit in 24 bits");
}

TEST(Error, WithoutErrnoOrHint) {
  const rdmakit::Error e("bootstrap decode", 0, "bad magic 0x12345678");
  EXPECT_EQ(std::string(e.what()), "bootstrap decode failed: bad magic 0x12345678");
  EXPECT_EQ(e.sys_errno(), 0);
  EXPECT_TRUE(e.hint().empty());
}

TEST(Error, MultiLineDetailPutsTheHintOnItsOwnLine) {
  const rdmakit::Error e("ibv_modify_qp(RTR->RTS)", EINVAL, "attributes:\n    timeout 17", "check it");
  EXPECT_EQ(std::string(e.what()),
            "ibv_modify_qp(RTR->RTS) failed: EINVAL (Invalid argument): attributes:\n    timeout 17\n"
            "  Hint: check it");
}

TEST(Error, IsARuntimeError) {
  try {
    throw rdmakit::Error("ibv_reg_mr", ENOMEM, "64 KiB", "raise RLIMIT_MEMLOCK");
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("ENOMEM"), std::string::npos);
    return;
  }
  FAIL() << "not caught as std::runtime_error";
}

TEST(ErrnoName, KnownAndUnknown) {
  EXPECT_EQ(rdmakit::errno_name(EINVAL), "EINVAL");
  EXPECT_EQ(rdmakit::errno_name(ETIMEDOUT), "ETIMEDOUT");
  EXPECT_EQ(rdmakit::errno_name(99999), "errno 99999");
}

}  // namespace
