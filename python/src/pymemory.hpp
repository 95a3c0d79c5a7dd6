// SPDX-License-Identifier: Apache-2.0
// Memory that Python objects hold: found through the buffer protocol or DLPack, and held (the
// object referenced, its export kept open) for as long as rdmakit may touch it.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "rdmakit/memory.hpp"

struct DLManagedTensor;

namespace rdmakit::python {

namespace py = pybind11;

/// Where memory lives, as DLPack names it (only the kinds rdmakit can register).
enum class MemoryPlace : std::uint8_t { host, cuda, cuda_host, dmabuf };
const char* to_string(MemoryPlace place) noexcept;

/// The bytes of a Python object: address, length, and whether the object lets them be written.
struct MemoryOf {
  void* addr = nullptr;
  std::size_t nbytes = 0;
  bool readonly = false;
  MemoryPlace place = MemoryPlace::host;
  int device = 0;  ///< the CUDA ordinal for cuda memory
};

/// An object's memory, held: the object is referenced and its export (the buffer-protocol view or
/// the DLPack tensor) stays open until this is destroyed, so the memory can neither be freed nor
/// (for a bytearray) resized under a registration. Destroy with the GIL held.
class HeldMemory {
 public:
  /// Takes the memory of `obj`: the buffer protocol first (bytes, bytearray, memoryview, mmap,
  /// numpy arrays), then `__dlpack__` (torch tensors, CUDA tensors). Throws BufferError (the
  /// module's) for an object that has neither, or whose memory is not one contiguous range.
  static std::unique_ptr<HeldMemory> take(py::handle obj, const char* what);
  HeldMemory(const HeldMemory&) = delete;
  HeldMemory& operator=(const HeldMemory&) = delete;
  ~HeldMemory();

  [[nodiscard]] const MemoryOf& memory() const noexcept { return mem_; }
  [[nodiscard]] py::object object() const { return obj_; }

 private:
  HeldMemory() = default;
  py::object obj_;
  MemoryOf mem_;
  bool has_view_ = false;
  Py_buffer view_{};
  DLManagedTensor* dl_ = nullptr;
};

/// The memory of `obj` without holding it (for a transfer's local range, which must lie in a
/// registration that holds it). Cheaper than HeldMemory::take: no DLPack round trip for torch
/// tensors. Throws BufferError as take() does.
MemoryOf memory_of(py::handle obj, const char* what);

/// The length of [offset, offset + length) within `size` bytes of local memory: `length` unset
/// means `fallback`, or else the rest from `offset`. BufferError naming `op` when it does not fit.
std::uint64_t local_range(const char* op, std::uint64_t size, std::uint64_t offset,
                          std::optional<std::uint64_t> length,
                          std::optional<std::uint64_t> fallback = {});

/// BufferError naming `op` and `subject` when read-only memory would be given to peers to write
/// or to run atomics on (`access` as the caller spelled it, for the message).
void refuse_remote_writes(const char* op, const std::string& subject, bool readonly,
                          Access access, const std::string& letters);

/// Raises the module's BufferError (an rdmakit.Error and a builtins.BufferError).
[[noreturn]] void throw_buffer_error(const char* op, const std::string& message,
                                     const std::string& hint = {});

}  // namespace rdmakit::python
