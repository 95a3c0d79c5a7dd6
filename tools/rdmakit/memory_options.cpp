#include "memory_options.hpp"

#include <CLI/CLI.hpp>

#include <fcntl.h>
#include <unistd.h>
#include <xf86drm.h>

#include <cerrno>
#include <filesystem>
#include <memory>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::tools {
namespace {

// A dma-buf from vgem: a dumb buffer of at least `bytes`, exported read-write.
class VgemBuffer {
 public:
  explicit VgemBuffer(std::size_t bytes) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/dev/dri", ec)) {
      if (e.path().filename().string().rfind("card", 0) != 0) continue;
      const int fd = ::open(e.path().c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) continue;
      drmVersionPtr v = drmGetVersion(fd);
      const bool vgem = v != nullptr && std::string(v->name, static_cast<std::size_t>(v->name_len)) == "vgem";
      if (v != nullptr) drmFreeVersion(v);
      if (vgem) {
        card_ = fd;
        break;
      }
      ::close(fd);
    }
    if (card_ < 0) {
      throw Error("dma-buf exporter", ENODEV, "no vgem device in /dev/dri",
                  "--mem dmabuf takes its dma-buf from vgem here: modprobe vgem");
    }
    drm_mode_create_dumb dumb{};
    dumb.width = 1024;  // 1024 x 32-bit pixels: 4 KiB rows
    dumb.bpp = 32;
    dumb.height = static_cast<std::uint32_t>((bytes + 4095) / 4096);
    if (drmIoctl(card_, DRM_IOCTL_MODE_CREATE_DUMB, &dumb) != 0) {
      throw Error("DRM_IOCTL_MODE_CREATE_DUMB", errno, fmt::format("{} bytes on vgem", bytes));
    }
    handle_ = dumb.handle;
    if (drmPrimeHandleToFD(card_, handle_, DRM_CLOEXEC | DRM_RDWR, &fd_) != 0) {
      throw Error("drmPrimeHandleToFD", errno, "exporting the vgem buffer as a dma-buf");
    }
  }
  ~VgemBuffer() {
    if (fd_ >= 0) ::close(fd_);
    if (handle_ != 0) {
      drm_mode_destroy_dumb d{handle_};
      drmIoctl(card_, DRM_IOCTL_MODE_DESTROY_DUMB, &d);
    }
    if (card_ >= 0) ::close(card_);
  }
  [[nodiscard]] int fd() const { return fd_; }

 private:
  int card_ = -1;
  std::uint32_t handle_ = 0;
  int fd_ = -1;
};

}  // namespace

void MemOptions::add_to(CLI::App& app) {
  app.add_option("--mem", mem, "memory to move: host, hugepage, cuda, cuda-host or dmabuf")
      ->check(CLI::IsMember({"host", "hugepage", "cuda", "cuda-host", "dmabuf"}))
      ->capture_default_str();
  app.add_option("--gpu", gpu, "CUDA device for --mem cuda / cuda-host")->capture_default_str();
}

MemoryKind MemOptions::kind() const { return parse_memory_kind(mem).value_or(MemoryKind::host); }

void MemOptions::check(std::size_t bytes) const {
  if (kind() == MemoryKind::dmabuf) {
    VgemBuffer probe(4096);  // an exporter is there
    return;
  }
  check_memory({kind(), gpu, -1, 0}, bytes);
}

const MemoryRegion& MemOptions::allocate(Connection& c, std::size_t bytes, Access access) const {
  if (kind() != MemoryKind::dmabuf) return c.allocate_memory(bytes, access, {kind(), gpu, -1, 0});
  // The region keeps its own dup of the fd and its mapping; the buffer lives while either does.
  VgemBuffer buf(bytes);
  return c.allocate_memory(bytes, access, {MemoryKind::dmabuf, 0, buf.fd(), 0});
}

std::string describe_memory(const MemoryRegion& m) {
  return fmt::format("{} memory, registered by {}{}", to_string(m.kind()), to_string(m.path()),
                     m.path_detail().empty() ? "" : " (" + m.path_detail() + ")");
}

}  // namespace rdmakit::tools
