// SPDX-License-Identifier: Apache-2.0
// The smallest complete rdmakit program: `write_and_read --listen PORT` on one host,
// `write_and_read HOST:PORT` on the other. The client RDMA-WRITEs a greeting into the server's
// buffer; the server waits until the client says BYE and prints what landed.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include <rdmakit/connection.hpp>
#include <rdmakit/error.hpp>

using namespace std::chrono_literals;

int main(int argc, char** argv) try {
  if (argc == 3 && std::string(argv[1]) == "--listen") {
    rdmakit::Listener listener(argv[2], {}, [](rdmakit::Connection& c) {
      c.advertise(c.allocate_memory(4096, rdmakit::Access::remote_write));
    });
    auto conn = listener.accept(60s);
    if (!conn) return 1;
    conn->wait_peer_close(10s);  // the client's BYE comes after its write completed
    std::printf("received: %s\n", static_cast<const char*>(conn->memory(0).data()));
    return 0;
  }
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s --listen PORT | HOST:PORT\n", argv[0]);
    return 2;
  }
  rdmakit::Connection conn = rdmakit::Connection::connect(argv[1], {}, [](rdmakit::Connection& c) {
    c.allocate_memory(4096, rdmakit::Access::none);  // a source only: no remote access at all
  });
  const auto& src = conn.memory(0);
  std::strcpy(static_cast<char*>(src.data()), "hello over RDMA");
  const auto post = conn.post_write(src.local().subslice(0, 16), conn.remote_regions().at(0), 0, 1);
  if (!post.ok()) {
    std::fprintf(stderr, "%s\n", post.describe().c_str());
    return 1;
  }
  const auto done = conn.wait(5s);
  if (done.status != rdmakit::WaitStatus::completed || !done.completion.ok()) {
    std::fprintf(stderr, "write failed: %s\n", done.completion.describe().c_str());
    return 1;
  }
  // ~Connection lets the write finish, says BYE, destroys the QP, deregisters the MRs (then
  // frees their memory), and releases the CQs, PD and context last.
  return 0;
} catch (const rdmakit::Error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
