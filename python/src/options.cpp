// SPDX-License-Identifier: Apache-2.0
#include "options.hpp"

#include <cerrno>
#include <cmath>
#include <tuple>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::python {

std::chrono::milliseconds to_ms(double seconds, const char* what) {
  if (!std::isfinite(seconds) || seconds < 0 || seconds > 1e9) {
    throw Error(what, EINVAL, fmt::format("timeout {} s is not a finite number of seconds >= 0",
                                          seconds),
                "every wait in rdmakit has a deadline: pass seconds, e.g. 10.0");
  }
  return std::chrono::milliseconds{static_cast<std::int64_t>(std::ceil(seconds * 1000.0))};
}

void set_fabric(ConnectionConfig& c, const std::string& gid, unsigned traffic_class, unsigned service_level,
                unsigned pkey_index, double ack_timeout, unsigned retry_count) {
  for (const auto& [what, v, most] : {std::tuple{"traffic_class", traffic_class, 255u},
                                      std::tuple{"service_level", service_level, 15u},
                                      std::tuple{"pkey_index", pkey_index, 65535u}, std::tuple{"retry_count", retry_count, 7u}}) {
    if (v > most) throw Error("connection config", EINVAL, fmt::format("{}={} (0..{})", what, v, most));
  }
  c.gid = GidSelector::parse(gid);
  c.traffic_class = static_cast<std::uint8_t>(traffic_class);
  c.service_level = static_cast<std::uint8_t>(service_level);
  c.pkey_index = static_cast<std::uint16_t>(pkey_index);
  c.ack_timeout = to_ms(ack_timeout, "ack_timeout");
  c.retry_count = static_cast<std::uint8_t>(retry_count);
}

Access parse_access(const std::string& letters, const char* op) {
  Access a = Access::none;
  for (char c : letters) {
    switch (c) {
      case 'r': a = a | Access::remote_read; break;
      case 'w': a = a | Access::remote_write; break;
      case 'a': a = a | Access::remote_atomic; break;
      default:
        throw Error(op, EINVAL, fmt::format("access \"{}\": '{}' is not r, w or a", letters, c),
                    "r: peers may read, w: write, a: run atomics; e.g. \"rw\"");
    }
  }
  return a;
}

Identity identity_from(const py::object& identity) {
  if (identity.is_none()) return {};
  if (py::isinstance<py::bytes>(identity) || py::isinstance<py::bytearray>(identity)) {
    std::string s = py::isinstance<py::bytes>(identity) ? std::string(identity.cast<py::bytes>())
                                                        : std::string(identity.cast<py::bytearray>());
    Identity id = Identity::from_seed({reinterpret_cast<const std::uint8_t*>(s.data()), s.size()});
    std::fill(s.begin(), s.end(), '\0');
    return id;
  }
  py::object path = py::module_::import("os").attr("fspath")(identity);
  return Identity::from_file(path.cast<std::string>());
}

std::vector<std::uint8_t> key_from(const py::object& psk) {
  if (psk.is_none()) return {};
  if (py::isinstance<py::bytes>(psk) || py::isinstance<py::bytearray>(psk)) {
    std::string s = py::isinstance<py::bytes>(psk) ? std::string(psk.cast<py::bytes>())
                                                   : std::string(psk.cast<py::bytearray>());
    return {s.begin(), s.end()};
  }
  py::object path = py::module_::import("os").attr("fspath")(psk);
  return read_key_file(path.cast<std::string>());
}

}  // namespace rdmakit::python
