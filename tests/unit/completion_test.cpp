// SPDX-License-Identifier: Apache-2.0
#include <infiniband/verbs.h>

#include <string>

#include <gtest/gtest.h>

#include "rdmakit/connection.hpp"

namespace {

using rdmakit::Completion;
using rdmakit::Opcode;
using rdmakit::PostResult;
using rdmakit::PostStatus;

std::string describe(int status, Opcode op = Opcode::write) {
  Completion c;
  c.wr_id = 7;
  c.opcode = op;
  c.status = status;
  c.vendor_err = 0x81;
  return c.describe();
}

TEST(Completion, SuccessIsShort) {
  EXPECT_EQ(describe(IBV_WC_SUCCESS, Opcode::read), "RDMA_READ wr_id=7 ok");
}

TEST(Completion, ErrorsNameStatusVendorErrorAndLikelyCause) {
  const std::string retry = describe(IBV_WC_RETRY_EXC_ERR);
  EXPECT_NE(retry.find("RDMA_WRITE wr_id=7 failed: transport retry counter exceeded (status 12, vendor_err 0x81)"),
            std::string::npos) << retry;
  EXPECT_NE(retry.find("peer process or host is gone"), std::string::npos) << retry;
  EXPECT_NE(describe(IBV_WC_REM_ACCESS_ERR).find("wrong rkey"), std::string::npos);
  EXPECT_NE(describe(IBV_WC_RNR_RETRY_EXC_ERR, Opcode::send).find("no receive posted"), std::string::npos);
  EXPECT_NE(describe(IBV_WC_WR_FLUSH_ERR).find("flushed"), std::string::npos);
  EXPECT_NE(describe(IBV_WC_LOC_PROT_ERR, Opcode::fetch_add).find("ATOMIC_FETCH_ADD"), std::string::npos);
}

TEST(PostResult, DescribesEachRefusal) {
  EXPECT_EQ(PostResult{}.describe(), "ok");
  const PostResult not_ready{PostStatus::not_ready, 0, 0};
  const PostResult misaligned{PostStatus::misaligned, 0, 3};
  const PostResult failed{PostStatus::failed, 12, 0};
  EXPECT_NE(not_ready.describe().find("not in RTS"), std::string::npos);
  EXPECT_NE(misaligned.describe().find("work request 3 of the batch"), std::string::npos);
  EXPECT_NE(failed.describe().find("ENOMEM"), std::string::npos);
}

}  // namespace
