// rdmakit keygen FILE: writes a fresh 32-byte pre-shared key (raw bytes, the format read_key_file
// reads) to a new file with mode 0600, for --psk-file on both hosts.
#include "keygen.hpp"

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include <fmt/core.h>

#include "rdmakit/connection.hpp"

namespace rdmakit::tools {

void add_keygen(CLI::App& app, std::function<int()>& run) {
  auto* cmd = app.add_subcommand("keygen", "Write a fresh pre-shared key (32 random bytes, mode 0600) to a new file");
  auto path = std::make_shared<std::string>();
  cmd->add_option("FILE", *path, "the key file to create (never overwritten)")->required();
  cmd->callback([&run, path] {
    run = [path] {
      generate_key_file(*path);
      fmt::print("wrote a 32-byte key to {} (mode 0600); give both sides --psk-file {}\n", *path, *path);
      return 0;
    };
  });
}

}  // namespace rdmakit::tools
