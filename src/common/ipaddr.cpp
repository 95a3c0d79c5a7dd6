// SPDX-License-Identifier: Apache-2.0
#include "common/ipaddr.hpp"

#include <arpa/inet.h>

#include <cstring>

namespace rdmakit::detail {

std::string format_ip16(const Ip16& addr) {
  char text[INET6_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET6, addr.data(), text, sizeof text);
  return text;
}

std::optional<Ip16> parse_ip16(const std::string& text) {
  Ip16 out{};
  in_addr v4{};
  if (::inet_pton(AF_INET, text.c_str(), &v4) == 1) {
    out[10] = 0xff;
    out[11] = 0xff;
    std::memcpy(out.data() + 12, &v4, 4);
    return out;
  }
  if (::inet_pton(AF_INET6, text.c_str(), out.data()) == 1) return out;
  return std::nullopt;
}

}  // namespace rdmakit::detail
