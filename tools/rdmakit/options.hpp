// SPDX-License-Identifier: Apache-2.0
#pragma once
// Options every connecting subcommand shares (device, port, GID, timeouts), mapped onto the
// library's ConnectionConfig.

#include <chrono>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

#include "cli_fwd.hpp"

#include "rdmakit/connection.hpp"

namespace rdmakit::tools {

inline constexpr std::uint16_t kDefaultPort = 12025;  // the seed program's

/// Where a link's packets go on the fabric and how long it waits for them: the same options on
/// every command that makes connections or engine links (docs/hardware.md).
struct FabricOptions {
  std::string gid;
  unsigned traffic_class = 0;
  unsigned service_level = 0;
  unsigned pkey_index = 0;
  unsigned ack_timeout_ms = static_cast<unsigned>(ConnectionConfig{}.ack_timeout.count());
  unsigned retry_count = ConnectionConfig{}.retry_count;

  void add_to(CLI::App& app);
  /// Sets them on `cfg`.
  void apply(ConnectionConfig& cfg) const;
};

struct ConnectOptions {
  std::string listen;   // [ADDR:]PORT
  std::string connect;  // HOST:PORT
  std::string device;
  unsigned ib_port = 0;
  FabricOptions fabric;
  unsigned timeout_ms = 10'000;
  std::string method = "tcp";  // --cm
  std::string psk_file;     // --psk-file
  bool trace = false;       // --trace
  bool trace_json = false;  // a subcommand's --json makes trace lines JSON too

  CLI::Option* listen_opt = nullptr;
  CLI::Option* connect_opt = nullptr;

  void add_to(CLI::App& app);
  /// --listen given (with or without an address); otherwise --connect is required.
  [[nodiscard]] bool serving() const;
  /// "HOST:PORT" with the default port filled in where none was given.
  [[nodiscard]] std::string connect_target() const;
  [[nodiscard]] std::string listen_address() const;
  [[nodiscard]] ConnectionConfig config() const;
  [[nodiscard]] std::chrono::milliseconds timeout() const { return std::chrono::milliseconds{timeout_ms}; }
};

/// Adds --trace to a subcommand.
void add_trace_flag(CLI::App& app, bool& trace);

/// The negotiated parameters, as an indented block of lines.
std::string describe(const ConnectionInfo& info);

/// A subcommand's own failure (bad completion, peer gone, wrong data): printed without a stack of
/// context, exit status 1. Library setup errors arrive as rdmakit::Error and are printed by main.
class Fail : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Checks that exactly one role was chosen (CLI11 already refuses both).
void require_role(const ConnectOptions& net, const char* command);

/// Wraps a subcommand's body: Fail (and malformed peer messages) become "rdmakit NAME: why"
/// and exit status 1.
std::function<int()> guarded(std::string name, std::function<int()> body);

}  // namespace rdmakit::tools
