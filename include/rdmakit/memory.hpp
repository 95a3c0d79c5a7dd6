#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

struct ibv_mr;

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

  [[nodiscard]] void* data() const noexcept;
  [[nodiscard]] std::size_t size() const noexcept;
  [[nodiscard]] Access access() const noexcept;
  /// False once revoked: when its connection closes (or Connection::revoke), the MR is
  /// deregistered, so its rkey works for no one; the memory itself stays readable.
  [[nodiscard]] bool registered() const noexcept;
  /// The whole region as a local scatter-gather source or target.
  [[nodiscard]] LocalSlice local() const noexcept;
  /// The descriptor to advertise to a peer (addr, length, rkey, access).
  [[nodiscard]] RemoteRegion remote() const noexcept;

  struct Impl;

 private:
  friend class Connection;
  explicit MemoryRegion(std::unique_ptr<Impl> impl) noexcept;
  void deregister() noexcept;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rdmakit
