// SPDX-License-Identifier: Apache-2.0
#include "rdmakit/error.hpp"

#include <cstring>
#include <system_error>

#include <fmt/format.h>

namespace rdmakit {
namespace {

std::string compose(const std::string& op, int err, const std::string& detail,
                    const std::string& hint) {
  std::string msg = op;
  if (err != 0) {
    // std::system_category().message is thread-safe, unlike strerror.
    msg += fmt::format(" failed: {} ({})", errno_name(err),
                       std::system_category().message(err));
  } else {
    msg += " failed";
  }
  if (!detail.empty()) msg += fmt::format(": {}", detail);
  // A multi-line detail (an attribute listing) gets its hint on a line of its own.
  if (!hint.empty()) {
    msg += detail.find('\n') != std::string::npos ? "\n  Hint: " : ". Hint: ";
    msg += hint;
  }
  return msg;
}

}  // namespace

Error::Error(std::string op, int err, std::string detail, std::string hint)
    : std::runtime_error(compose(op, err, detail, hint)),
      op_(std::move(op)),
      errno_(err),
      detail_(std::move(detail)),
      hint_(std::move(hint)) {}

std::string errno_name(int err) {
  // glibc >= 2.32; returns nullptr for values without a name.
  const char* name = ::strerrorname_np(err);
  return name != nullptr ? std::string(name) : fmt::format("errno {}", err);
}

}  // namespace rdmakit
