// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit {

/// The exception every rdmakit setup call throws.
///
/// It names the operation that failed (a verb such as `ibv_modify_qp(INIT->RTR)`, or a library
/// step such as `bootstrap connect`), the errno it returned (0 when the failure was not a system
/// error), what was being done with which values, and the likely cause with what to do about it.
/// Data-path calls never throw: a failed work completion is data, not an exception.
class Error : public std::runtime_error {
 public:
  /// @param op      the verb or step that failed
  /// @param err     errno from that call, or 0
  /// @param detail  what was being done, with the values involved
  /// @param hint    the likely cause and the fix, or empty when there is nothing useful to say
  Error(std::string op, int err, std::string detail, std::string hint = {});

  /// The verb or step that failed, e.g. `ibv_reg_mr`.
  [[nodiscard]] const std::string& op() const noexcept { return op_; }
  /// errno from the failing call, 0 when it was not a system error.
  [[nodiscard]] int sys_errno() const noexcept { return errno_; }
  /// What was being done, with the values involved.
  [[nodiscard]] const std::string& detail() const noexcept { return detail_; }
  /// The likely cause and the fix; may be empty.
  [[nodiscard]] const std::string& hint() const noexcept { return hint_; }

 private:
  std::string op_;
  int errno_;
  std::string detail_;
  std::string hint_;
};

/// The symbolic name of an errno value ("EINVAL"), or "errno N" when it has none.
[[nodiscard]] std::string errno_name(int err);

}  // namespace rdmakit
#pragma GCC visibility pop
