// SPDX-License-Identifier: Apache-2.0
// rdmakit: the command-line front of the library. Each subcommand is a thin layer over the public
// API: the tool has no private path into the library.
#include <cstdio>
#include <functional>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "bench.hpp"
#include "devices.hpp"
#include "engine_cmds.hpp"
#include "hello.hpp"
#include "keygen.hpp"
#include "stats.hpp"
#include "metadata_options.hpp"
#include "rdmakit/error.hpp"
#include "rdmakit/version.hpp"

int main(int argc, char** argv) {
  CLI::App app{"rdmakit: correct, fast and debuggable RDMA between hosts", "rdmakit"};
  app.set_version_flag("-V,--version", std::string(rdmakit::version()));
  app.require_subcommand(1);
  std::function<int()> run;
  rdmakit::tools::add_hello(app, run);
  rdmakit::tools::add_bench(app, run);
  rdmakit::tools::add_devices(app, run);
  rdmakit::tools::add_doctor(app, run);
  rdmakit::tools::add_keygen(app, run);
  rdmakit::tools::add_serve(app, run);
  rdmakit::tools::add_engine_bench(app, run);
  rdmakit::tools::add_peers(app, run);
  rdmakit::tools::add_stats(app, run);
  CLI11_PARSE(app, argc, argv);
  try {
    return run();
  } catch (const rdmakit::Error& e) {
    fmt::print(stderr, "rdmakit: {}\n", e.what());
    return 1;
  }
}
