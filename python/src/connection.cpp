// SPDX-License-Identifier: Apache-2.0
// rdmakit.connect, rdmakit.Listener and rdmakit.Connection, over rdmakit::Connection: one peer,
// posts and completions driven by the caller.
#include "connection.hpp"
#include "logs.hpp"

#include <pybind11/stl.h>

#include <cerrno>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "errors.hpp"
#include "options.hpp"
#include "pymemory.hpp"
#include "rdmakit/connection.hpp"

namespace rdmakit::python {
namespace {

// Objects whose memory a connection registers, held (with the GIL) as long as any connection
// that registered them lives.
struct Held {
  struct Item {
    std::unique_ptr<HeldMemory> mem;
    Access access;
  };
  std::vector<Item> items;
  ~Held() {
    py::gil_scoped_acquire gil;
    items.clear();
  }
};

Held::Item hold(py::handle obj, const std::string& access) {
  Access remote = parse_access(access, "register");
  auto mem = HeldMemory::take(obj, "register");
  const MemoryOf& m = mem->memory();
  if (m.nbytes == 0) throw_buffer_error("register", "the object has no bytes");
  refuse_remote_writes("register", "the object", m.readonly, remote, access);
  // A writable object may also be the target of this side's READs and atomics.
  Access a = m.readonly ? remote : (remote | Access::local_write);
  return {std::move(mem), a};
}

// (obj, "rw") pairs or bare objects ("rw").
std::shared_ptr<Held> hold_all(const py::iterable& advertise) {
  auto held = std::make_shared<Held>();
  for (py::handle h : advertise) {
    if (py::isinstance<py::tuple>(h) && py::len(h) == 2) {
      auto t = h.cast<py::tuple>();
      held->items.push_back(hold(t[0], t[1].cast<std::string>()));
    } else {
      held->items.push_back(hold(h, "rw"));
    }
  }
  return held;
}

// What a handshake's setup does with the held objects: register each and advertise it. Runs on
// handshake threads without the GIL, so it captures addresses, never Python objects.
Connection::Setup advertiser(const std::shared_ptr<Held>& held) {
  struct Range {
    void* addr;
    std::size_t len;
    Access access;
  };
  std::vector<Range> ranges;
  for (const Held::Item& i : held->items) {
    ranges.push_back({i.mem->memory().addr, i.mem->memory().nbytes, i.access});
  }
  return [ranges](Connection& c) {
    for (const Range& r : ranges) c.advertise(c.register_memory(r.addr, r.len, r.access));
  };
}

ConnectionConfig config_from(const py::object& psk, std::string device, double handshake_timeout,
                             std::uint32_t qps, const std::string& method) {
  ConnectionConfig c;
  c.method = parse_connect_method(method);
  c.psk = key_from(psk);
  c.device = std::move(device);
  c.handshake_timeout = to_ms(handshake_timeout, "handshake_timeout");
  c.qps = qps;
  start_log_pump();
  c.log = python_log();
  return c;
}


/// rdmakit.Connection. Its calls are serialised by a mutex (a Connection is one thread's at a
/// time), and those that wait run without the GIL.
class PyConnection {
 public:
  PyConnection(Connection c, std::shared_ptr<Held> advertised)
      : advertised_(std::move(advertised)), mine_(std::make_shared<Held>()),
        conn_(std::move(c)) {}
  ~PyConnection() { close(2.0); }

  template <class F>
  auto call(F&& f) {
    py::gil_scoped_release nogil;
    std::lock_guard lock(mu_);
    if (!conn_) throw Error("connection", EBADF, "the connection is closed");
    return f(*conn_);
  }
  void close(double timeout) {
    auto t = to_ms(timeout, "close");
    {
      py::gil_scoped_release nogil;
      std::lock_guard lock(mu_);
      if (conn_) conn_->close(t);
      conn_.reset();
    }
  }

  /// Regions: the advertised ones first (in order), then those registered later.
  std::size_t register_object(py::handle obj, const std::string& access) {
    Held::Item item = hold(obj, access);
    void* addr = item.mem->memory().addr;
    std::size_t len = item.mem->memory().nbytes;
    Access a = item.access;
    mine_->items.push_back(std::move(item));
    return call([&](Connection& c) {
      c.register_memory(addr, len, a);
      return c.memory_count() - 1;
    });
  }

  PostResult post(Opcode op, std::size_t region, std::uint64_t local_offset,
                  std::optional<std::uint64_t> length, const RemoteRegion& remote,
                  std::uint64_t remote_offset, std::uint64_t wr_id) {
    return call([&](Connection& c) {
      const MemoryRegion& mr = c.memory(region);
      const std::uint64_t n = local_range("post", mr.size(), local_offset, length);
      LocalSlice s = mr.local().subslice(local_offset, n);
      return op == Opcode::write ? c.post_write(s, remote, remote_offset, wr_id)
                                 : c.post_read(s, remote, remote_offset, wr_id);
    });
  }

 private:
  std::mutex mu_;
  // Declared before conn_, so the objects are let go only after its MRs are deregistered.
  std::shared_ptr<Held> advertised_;
  std::shared_ptr<Held> mine_;
  std::optional<Connection> conn_;
};


py::object completion_of(const WaitResult& r, const std::string& failure) {
  switch (r.status) {
    case WaitStatus::completed: {
      py::dict d;
      d["wr_id"] = r.completion.wr_id;
      d["opcode"] = to_string(r.completion.opcode);
      d["status"] = r.completion.status_name();
      d["ok"] = r.completion.ok();
      d["byte_len"] = r.completion.byte_len;
      d["describe"] = r.completion.ok() ? std::string() : r.completion.describe();
      return d;
    }
    case WaitStatus::timeout:
      throw KindedError(ErrorKind::timeout, "Connection.wait", ETIMEDOUT,
                        "no completion before the deadline");
    case WaitStatus::peer_lost:
    case WaitStatus::closed:
      throw KindedError(ErrorKind::peer_lost, "Connection.wait", 0,
                        failure.empty() ? "the connection is closed" : failure);
    case WaitStatus::device_error:
      throw Error("Connection.wait", 0, failure);
  }
  return py::none();
}

}  // namespace

void bind_connection(py::module_& m) {
  py::class_<RemoteRegion>(m, "RemoteRegion", "Memory the peer advertised: addr, length, rkey.")
      .def_readonly("addr", &RemoteRegion::addr)
      .def_readonly("length", &RemoteRegion::length)
      .def_readonly("rkey", &RemoteRegion::rkey)
      .def_property_readonly("access", [](const RemoteRegion& r) { return to_string(r.access); })
      .def("__repr__", [](const RemoteRegion& r) {
        return fmt::format("<rdmakit.RemoteRegion {} bytes at {:#x} rkey {:#x} {}>", r.length,
                           r.addr, r.rkey, to_string(r.access));
      });

  py::class_<PyConnection, std::shared_ptr<PyConnection>> cls(
      m, "Connection",
      "One RC connection to one peer (rdmakit.connect, Listener.accept). Regions are numbered: "
      "the advertised objects first, then each register() in turn. Calls are serialised; those "
      "that wait release the GIL.");
  cls.def("register", &PyConnection::register_object, py::arg("obj"), py::arg("access") = "",
           "Registers obj's memory in this connection (access: r, w, a for the peer; \"\" local "
           "only); returns its region number.")
      .def_property_readonly("remote_regions", [](PyConnection& c) {
        return c.call([](Connection& x) { return x.remote_regions(); });
      })
      .def_property_readonly("info", [](PyConnection& c) {
        ConnectionInfo i = c.call([](Connection& x) { return x.info(); });
        py::dict d;
        d["device"] = i.device;
        d["port"] = i.port;
        d["path_mtu"] = i.path_mtu;
        d["max_msg_size"] = i.max_msg_size;
        d["max_inline"] = i.max_inline;
        d["qps"] = i.qps;
        d["atomics"] = i.atomics;
        d["peer_address"] = i.peer_address;
        d["gid_reason"] = i.gid_reason;
        d["device_reason"] = i.device_reason;
        d["traffic_class"] = i.traffic_class;
        d["service_level"] = i.service_level;
        d["pkey_index"] = i.pkey_index;
        d["ack_timeout"] = std::chrono::duration<double>(i.ack_timeout).count();
        d["retry_count"] = i.retry_count;
        return d;
      })
      .def(
          "wait",
          [](PyConnection& c, double timeout) {
            auto t = to_ms(timeout, "Connection.wait");
            std::string failure;
            WaitResult r = c.call([&](Connection& x) {
              WaitResult w = x.wait(t);
              failure = x.failure();
              return w;
            });
            return completion_of(r, failure);
          },
          py::arg("timeout") = 10.0,
          "The next completion as a dict (wr_id, opcode, status, ok, byte_len, describe): a "
          "failed operation is a completion with ok False. TimeoutError when none comes; "
          "PeerLostError when the peer is gone.")
      .def(
          "send_message",
          [](PyConnection& c, const py::bytes& data, double timeout) {
            std::string_view s = data;
            auto t = to_ms(timeout, "send_message");
            c.call([&](Connection& x) {
              x.send_message({reinterpret_cast<const std::uint8_t*>(s.data()), s.size()}, t);
            });
          },
          py::arg("data"), py::arg("timeout") = 10.0,
          "Sends a small message (at most 1000 bytes) on the control channel.")
      .def(
          "receive_message",
          [](PyConnection& c, double timeout) {
            auto t = to_ms(timeout, "receive_message");
            bool closed = false;
            auto msg = c.call([&](Connection& x) {
              auto r = x.receive_message(t);
              if (!r) closed = x.peer_closed();
              return r;
            });
            if (!msg) {
              if (closed) {
                throw KindedError(ErrorKind::peer_lost, "receive_message", 0,
                                  "the peer closed the connection");
              }
              throw KindedError(ErrorKind::timeout, "receive_message", ETIMEDOUT,
                                "no message before the deadline");
            }
            return py::bytes(reinterpret_cast<const char*>(msg->data()), msg->size());
          },
          py::arg("timeout") = 10.0)
      .def("close", &PyConnection::close, py::arg("timeout") = 2.0,
           "Lets what is in flight finish (within timeout), says BYE, deregisters.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyConnection& c, py::args) { c.close(2.0); });
  for (auto [name, op, what] : {std::tuple{"write", Opcode::write,
                                           "Posts an RDMA WRITE from a local region to the peer's"},
                                std::tuple{"read", Opcode::read,
                                           "Posts an RDMA READ from the peer's region into a local "
                                           "one"}}) {
    cls.def(
        name,
        [op = op, name = name](PyConnection& c, std::size_t region, const RemoteRegion& remote,
                               std::uint64_t remote_offset, std::uint64_t local_offset,
                               std::optional<std::uint64_t> length, std::uint64_t wr_id) {
          PostResult r = c.post(op, region, local_offset, length, remote, remote_offset, wr_id);
          if (!r.ok()) throw KindedError(ErrorKind::post, name, r.sys_errno, r.describe());
        },
        py::arg("region"), py::arg("remote"), py::kw_only(), py::arg("remote_offset") = 0,
        py::arg("local_offset") = 0, py::arg("length") = py::none(), py::arg("wr_id") = 0,
        (std::string(what) + "; PostError (with the reason) if refused.").c_str());
  }

  m.def(
      "connect",
      [](const std::string& address, const py::iterable& advertise, const py::object& psk,
         std::string device, double handshake_timeout, std::uint32_t qps, const std::string& method,
         const std::string& gid, unsigned traffic_class, unsigned service_level, unsigned pkey_index,
         double ack_timeout, unsigned retry_count) {
        auto held = hold_all(advertise);
        ConnectionConfig cfg = config_from(psk, std::move(device), handshake_timeout, qps, method);
        set_fabric(cfg, gid, traffic_class, service_level, pkey_index, ack_timeout, retry_count);
        cfg.retry_refused = true;
        Connection::Setup setup = advertiser(held);
        std::optional<Connection> conn;
        {
          py::gil_scoped_release nogil;
          conn.emplace(Connection::connect(address, cfg, setup));
        }
        return std::make_shared<PyConnection>(std::move(*conn), held);
      },
      py::arg("address"), py::kw_only(), py::arg("advertise") = py::tuple(),
      py::arg("psk") = py::none(), py::arg("device") = "", py::arg("handshake_timeout") = 10.0,
      py::arg("qps") = 1, py::arg("method") = "tcp", py::arg("gid") = "", py::arg("traffic_class") = 0,
      py::arg("service_level") = 0, py::arg("pkey_index") = 0,
      py::arg("ack_timeout") = std::chrono::duration<double>(ConnectionConfig{}.ack_timeout).count(),
      py::arg("retry_count") = ConnectionConfig{}.retry_count,
      "Connects to a Listener at \"host:port\". advertise: objects (or (obj, access) pairs, "
      "access letters r, w, a) the peer may reach, registered before the handshake. method: "
      "\"tcp\" (rdmakit's TCP bootstrap) or \"rdma_cm\" (the connection manager; the port is "
      "an rdma_cm port), as the listener uses. gid, traffic_class, service_level, pkey_index, "
      "ack_timeout (seconds), retry_count: the fabric settings (ConnectionConfig, docs/hardware.md).");

  struct PyListener {
    std::shared_ptr<Held> held;
    std::unique_ptr<Listener> listener;
  };
  py::class_<PyListener>(m, "Listener", "Accepts connections; every one gets `advertise`.")
      .def(py::init([](const std::string& address, const py::iterable& advertise,
                       const py::object& psk, std::string device, double handshake_timeout,
                       const std::string& method, const std::string& gid, unsigned traffic_class,
                       unsigned service_level, unsigned pkey_index, double ack_timeout, unsigned retry_count) {
             auto l = std::make_unique<PyListener>();
             l->held = hold_all(advertise);
             ListenerConfig cfg(config_from(psk, std::move(device), handshake_timeout, 1, method));
             set_fabric(cfg.connection, gid, traffic_class, service_level, pkey_index, ack_timeout, retry_count);
             Connection::Setup setup = advertiser(l->held);
             py::gil_scoped_release nogil;
             l->listener = std::make_unique<Listener>(address, cfg, setup);
             return l;
           }),
           py::arg("address") = ":0", py::kw_only(), py::arg("advertise") = py::tuple(),
           py::arg("psk") = py::none(), py::arg("device") = "",
           py::arg("handshake_timeout") = 10.0, py::arg("method") = "tcp", py::arg("gid") = "",
           py::arg("traffic_class") = 0, py::arg("service_level") = 0, py::arg("pkey_index") = 0,
           py::arg("ack_timeout") = std::chrono::duration<double>(ConnectionConfig{}.ack_timeout).count(),
           py::arg("retry_count") = ConnectionConfig{}.retry_count)
      .def_property_readonly("port",
                             [](const PyListener& l) { return l.listener ? l.listener->port() : 0; })
      .def(
          "accept",
          [](PyListener& l, double timeout) {
            auto t = to_ms(timeout, "accept");
            if (!l.listener) throw Error("Listener.accept", EBADF, "the listener is closed");
            std::optional<Connection> c;
            {
              py::gil_scoped_release nogil;
              c = l.listener->accept(t);
            }
            if (!c) {
              throw KindedError(ErrorKind::timeout, "Listener.accept", ETIMEDOUT,
                                "no connection before the deadline");
            }
            return std::make_shared<PyConnection>(std::move(*c), l.held);
          },
          py::arg("timeout") = 10.0)
      .def("close", [](PyListener& l) {
        py::gil_scoped_release nogil;
        l.listener.reset();
      });
}

}  // namespace rdmakit::python
