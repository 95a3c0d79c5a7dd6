// SPDX-License-Identifier: Apache-2.0
#pragma once
// CLI11's types as the tools' headers name them (by reference or pointer only). CLI/CLI.hpp is
// one large header: each .cpp that builds options includes it itself, the others never parse it.
namespace CLI {
class App;
class Option;
}  // namespace CLI
