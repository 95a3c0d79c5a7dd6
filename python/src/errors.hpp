// SPDX-License-Identifier: Apache-2.0
// The module's exceptions: rdmakit.Error and its subclasses, raised from rdmakit::Error.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <string>
#include <vector>

#include "rdmakit/error.hpp"

namespace rdmakit::python {

namespace py = pybind11;

/// Which Python class an error is raised as (rdmakit.Error when plain).
enum class ErrorKind { error, buffer, timeout, peer_lost, post, transfer };

/// One failed transfer of a batch: its index, status name and reason.
struct Failure {
  std::size_t index;
  std::string status;
  std::string reason;
};

/// An rdmakit::Error that says which Python class it becomes, and (a batch's) failed transfers.
class KindedError : public Error {
 public:
  KindedError(ErrorKind kind, std::string op, int err, std::string detail, std::string hint = {},
              std::vector<Failure> failures = {})
      : Error(std::move(op), err, std::move(detail), std::move(hint)),
        kind_(kind),
        failures_(std::move(failures)) {}
  [[nodiscard]] ErrorKind kind() const noexcept { return kind_; }
  [[nodiscard]] const std::vector<Failure>& failures() const noexcept { return failures_; }

 private:
  ErrorKind kind_;
  std::vector<Failure> failures_;
};

/// Creates the exception classes in `m` and translates rdmakit::Error into them: a KindedError
/// by its kind, any other by its errno (ETIMEDOUT: TimeoutError; a reset, refused or broken
/// connection: PeerLostError). Every instance carries verb, errno, detail and hint.
void register_errors(py::module_& m);

}  // namespace rdmakit::python
