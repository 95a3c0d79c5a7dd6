// SPDX-License-Identifier: Apache-2.0
// Conversions of Python arguments shared by the bindings: seconds to deadlines, keys.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "rdmakit/connection.hpp"
#include "rdmakit/identity.hpp"
#include "rdmakit/memory.hpp"

namespace rdmakit::python {

namespace py = pybind11;

/// Seconds (a float, as Python's own timeouts are) to milliseconds; a negative, NaN or
/// infinite value is refused (every wait in rdmakit has a deadline).
std::chrono::milliseconds to_ms(double seconds, const char* what);

/// The fabric settings every connecting call takes (gid: an index or an address, "" for the
/// route's; traffic_class; service_level; pkey_index; ack_timeout in seconds; retry_count),
/// set on `c`; a value out of its range is refused.
void set_fabric(ConnectionConfig& c, const std::string& gid, unsigned traffic_class, unsigned service_level,
                unsigned pkey_index, double ack_timeout, unsigned retry_count);

/// Remote access from letters: r (read), w (write), a (atomics); "" is none. `op` names the
/// call in the error for any other letter.
Access parse_access(const std::string& letters, const char* op);

/// A pre-shared key: None (none), bytes (the key), or a str/PathLike naming a key file
/// (read_key_file's checks apply).
std::vector<std::uint8_t> key_from(const py::object& psk);
/// An identity from None (none), a 32-byte seed (bytes), or an identity file's path.
rdmakit::Identity identity_from(const py::object& identity);

}  // namespace rdmakit::python
