// SPDX-License-Identifier: Apache-2.0
#pragma once
// A dma-buf from vgem, the kernel's virtual GEM driver: the lab's stand-in for an accelerator's
// exporter (rdmakit hello/bench --mem dmabuf, and the engine's dma-buf tests).
#include <fcntl.h>
#include <unistd.h>
#include <xf86drm.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::tools {

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

}  // namespace rdmakit::tools
