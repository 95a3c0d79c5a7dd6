// rdmakit: the command-line front of the library. Each subcommand is a thin layer over the public
// API: the tool has no private path into the library.
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "rdmakit/version.hpp"

int main(int argc, char** argv) {
  CLI::App app{"rdmakit: correct, fast and debuggable RDMA between hosts", "rdmakit"};
  app.set_version_flag("-V,--version", std::string(rdmakit::version()));
  CLI11_PARSE(app, argc, argv);
  fmt::print("{}", app.help());
  return 0;
}
