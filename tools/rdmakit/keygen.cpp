// SPDX-License-Identifier: Apache-2.0
// rdmakit keygen FILE: writes a fresh 32-byte pre-shared key (raw bytes, the format read_key_file
// reads) to a new file with mode 0600, for --psk-file on both hosts. With --identity, an engine's
// identity instead (Identity::save: FILE, mode 0600, and its public key in FILE.pub).
#include "keygen.hpp"

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include <fmt/core.h>

#include "rdmakit/connection.hpp"
#include "rdmakit/identity.hpp"

namespace rdmakit::tools {

void add_keygen(CLI::App& app, std::function<int()>& run) {
  auto* cmd = app.add_subcommand("keygen", "Write a fresh pre-shared key (32 random bytes, mode 0600) to a new file, "
                                             "or with --identity an engine's identity");
  auto path = std::make_shared<std::string>();
  auto identity = std::make_shared<bool>(false);
  cmd->add_option("FILE", *path, "the key file to create (never overwritten)")->required();
  cmd->add_flag("--identity", *identity,
                "write an engine identity (an Ed25519 key pair): the secret to FILE (mode 0600), the public key "
                "to FILE.pub");
  cmd->callback([&run, path, identity] {
    run = [path, identity] {
      if (*identity) {
        const Identity id = Identity::generate();
        id.save(*path);
        fmt::print("wrote an identity to {} (mode 0600) and its public key to {}.pub:\n{}\n"
                   "give the engine --identity {}; its peers --peer-key NAME={}\n",
                   *path, *path, id.public_key(), *path, id.public_key());
        return 0;
      }
      generate_key_file(*path);
      fmt::print("wrote a 32-byte key to {} (mode 0600); give both sides --psk-file {}\n", *path, *path);
      return 0;
    };
  });
}

}  // namespace rdmakit::tools
