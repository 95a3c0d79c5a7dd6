// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

struct ibv_mr;

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit {

/// What a peer (or the local NIC) may do with registered memory. Register with the least the use
/// needs: a buffer only written by peers needs remote_write, not remote_read.
enum class Access : std::uint32_t {
  none = 0,
  local_write = 1u << 0,    ///< the NIC may write it locally (RECV target, READ destination)
  remote_read = 1u << 1,    ///< peers may RDMA READ it
  remote_write = 1u << 2,   ///< peers may RDMA WRITE it
  remote_atomic = 1u << 3,  ///< peers may run atomics on it
};
[[nodiscard]] constexpr Access operator|(Access a, Access b) noexcept {
  return static_cast<Access>(static_cast<std::uint32_t>(a) | static_cast<std::uint32_t>(b));
}
[[nodiscard]] constexpr Access operator&(Access a, Access b) noexcept {
  return static_cast<Access>(static_cast<std::uint32_t>(a) & static_cast<std::uint32_t>(b));
}
/// True if every flag of `wanted` is in `have`.
[[nodiscard]] constexpr bool allows(Access have, Access wanted) noexcept {
  return (have & wanted) == wanted;
}
/// "remote_read|remote_write".
[[nodiscard]] std::string to_string(Access access);

/// Where a region's memory comes from (rdmakit hello/bench --mem).
enum class MemoryKind : std::uint8_t {
  host,       ///< page-aligned host memory
  hugepage,   ///< host memory on 2 MiB huge pages (they must be reserved)
  cuda,       ///< GPU memory (cuMemAlloc)
  cuda_host,  ///< pinned host memory from CUDA (cuMemHostAlloc: the seed's cudaMallocHost)
  dmabuf,     ///< memory another driver exports as a dma-buf (the seed's accelerator case)
};
/// "host", "hugepage", "cuda", "cuda-host", "dmabuf".
[[nodiscard]] const char* to_string(MemoryKind kind) noexcept;
[[nodiscard]] std::optional<MemoryKind> parse_memory_kind(std::string_view text) noexcept;

/// How the NIC reaches a region's memory.
enum class RegistrationPath : std::uint8_t {
  host_mr,    ///< ibv_reg_mr on host memory
  dmabuf_mr,  ///< ibv_reg_dmabuf_mr on the memory's dma-buf
  device_mr,  ///< ibv_reg_mr on a GPU pointer (what nvidia-peermem makes work)
  bounce,     ///< a registered host buffer; stage_in/stage_out copy to and from the memory
};
[[nodiscard]] const char* to_string(RegistrationPath path) noexcept;

/// What memory to allocate (Connection::allocate_memory).
struct MemorySpec {
  MemoryKind kind = MemoryKind::host;
  int gpu = 0;                      ///< cuda, cuda_host: the CUDA device ordinal
  int dmabuf_fd = -1;               ///< dmabuf: the exporter's fd (rdmakit keeps its own dup)
  std::uint64_t dmabuf_offset = 0;  ///< dmabuf: where the region starts in it
};

/// Throws Error saying why memory of this kind cannot be had on this host ("no CUDA device",
/// "no huge pages reserved", a bad dma-buf fd), so a program can find out before connecting.
void check_memory(const MemorySpec& spec, std::size_t length);

/// Local registered memory, as the local NIC sees it: what goes into a scatter-gather entry.
/// Only a MemoryRegion makes one, so an lkey here is always a real lkey.
class LocalSlice {
 public:
  [[nodiscard]] void* addr() const noexcept { return addr_; }
  [[nodiscard]] std::size_t length() const noexcept { return length_; }
  [[nodiscard]] std::uint32_t lkey() const noexcept { return lkey_; }
  /// Whether the NIC may write here (a READ or atomic result, or a RECV target).
  [[nodiscard]] bool writable() const noexcept { return writable_; }
  /// A slice of nothing (length 0, lkey 0), as a placeholder.
  [[nodiscard]] static LocalSlice empty() noexcept { return {nullptr, 0, 0, false}; }
  /// A sub-range; clamped to this slice (an out-of-range offset gives an empty slice).
  [[nodiscard]] LocalSlice subslice(std::size_t offset, std::size_t length) const noexcept;

 private:
  friend class MemoryRegion;
  LocalSlice(void* addr, std::size_t length, std::uint32_t lkey, bool writable) noexcept
      : addr_(addr), length_(length), lkey_(lkey), writable_(writable) {}
  void* addr_;
  std::size_t length_;
  std::uint32_t lkey_;
  bool writable_;
};

/// A peer's registered memory, as advertised to us: address, length, rkey and what it allows.
/// A different type from LocalSlice, so an rkey can never be passed where an lkey belongs.
struct RemoteRegion {
  std::uint64_t addr = 0;
  std::uint64_t length = 0;
  std::uint32_t rkey = 0;
  Access access = Access::none;

  /// True if [offset, offset + len) lies inside the region without overflow.
  [[nodiscard]] constexpr bool contains(std::uint64_t offset, std::uint64_t len) const noexcept {
    return offset <= length && len <= length - offset;
  }
  friend bool operator==(const RemoteRegion&, const RemoteRegion&) = default;
};

/// A registered memory region (ibv_mr) and, when rdmakit allocated it, the memory itself.
/// Move-only; deregisters on destruction. Keeps its protection domain alive.
class MemoryRegion {
 public:
  MemoryRegion(MemoryRegion&&) noexcept;
  MemoryRegion& operator=(MemoryRegion&&) noexcept;
  ~MemoryRegion();

  /// The bytes the NIC reads and writes, when the CPU can reach them (host kinds, a mapped
  /// dma-buf, a bounce buffer); nullptr for GPU memory registered directly.
  [[nodiscard]] void* data() const noexcept;
  [[nodiscard]] std::size_t size() const noexcept;
  [[nodiscard]] Access access() const noexcept;
  [[nodiscard]] MemoryKind kind() const noexcept;
  [[nodiscard]] RegistrationPath path() const noexcept;
  /// Why this path: what was tried before it and why that failed.
  [[nodiscard]] const std::string& path_detail() const noexcept;
  /// The memory itself when the CPU can reach it (host kinds, a mapped dma-buf), else nullptr.
  /// On the bounce path this is not data(): stage_in/stage_out move bytes between the two.
  [[nodiscard]] void* home() const noexcept;
  /// Bounce path: copies [offset, offset + length) from the memory into the registered buffer,
  /// before the NIC sends it or a peer reads it. No-op on the other paths. Throws Error.
  void stage_in(std::size_t offset, std::size_t length) const;
  /// Bounce path: copies [offset, offset + length) from the registered buffer back to the
  /// memory, after the NIC wrote it. No-op on the other paths. Throws Error.
  void stage_out(std::size_t offset, std::size_t length) const;
  /// False once revoked: when its connection closes (or Connection::revoke), the MR is
  /// deregistered, so its rkey works for no one; the memory itself stays readable.
  [[nodiscard]] bool registered() const noexcept;
  /// The whole region as a local scatter-gather source or target.
  [[nodiscard]] LocalSlice local() const noexcept;
  /// The descriptor to advertise to a peer (addr, length, rkey, access).
  [[nodiscard]] RemoteRegion remote() const noexcept;

  struct [[gnu::visibility("hidden")]] Impl;  // not exported: only the library sees it

 private:
  [[gnu::visibility("hidden")]] explicit MemoryRegion(std::unique_ptr<Impl> impl) noexcept;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rdmakit
#pragma GCC visibility pop
