// SPDX-License-Identifier: Apache-2.0
#include "pymemory.hpp"

#include <dlpack/dlpack.h>

#include <cerrno>

#include <fmt/format.h>

#include "errors.hpp"

namespace rdmakit::python {
namespace {

std::string type_name(py::handle obj) {
  return py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>();
}

// A DLPack tensor's bytes, when they form one range in row-major order (strides absent or
// compact); throws BufferError otherwise.
MemoryOf dl_memory(const DLTensor& t, py::handle obj, const char* what) {
  MemoryOf m;
  switch (t.device.device_type) {
    case kDLCPU:
      m.place = MemoryPlace::host;
      break;
    case kDLCUDA:
      m.place = MemoryPlace::cuda;
      break;
    case kDLCUDAHost:
      m.place = MemoryPlace::cuda_host;
      break;
    default:
      throw_buffer_error(what, fmt::format("{}: its memory is on DLPack device type {}, which "
                                           "rdmakit cannot register",
                                           type_name(obj), static_cast<int>(t.device.device_type)),
                         "use host, CUDA or CUDA-host memory");
  }
  m.device = t.device.device_id;
  std::uint64_t elem_bits = std::uint64_t{t.dtype.bits} * t.dtype.lanes;
  std::uint64_t count = 1;
  for (int d = 0; d < t.ndim; ++d) count *= static_cast<std::uint64_t>(t.shape[d]);
  if (t.strides != nullptr && count > 1) {
    std::int64_t expect = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (t.shape[d] != 1 && t.strides[d] != expect) {
        throw_buffer_error(
            what, fmt::format("{}: not contiguous (dimension {} has stride {} elements, {} "
                              "expected), so its memory is not one range",
                              type_name(obj), d, t.strides[d], expect),
            "pass a contiguous copy (.contiguous() for a torch tensor, "
            "numpy.ascontiguousarray for an array)");
      }
      expect *= t.shape[d];
    }
  }
  m.addr = static_cast<char*>(t.data) + t.byte_offset;
  m.nbytes = static_cast<std::size_t>((count * elem_bits + 7) / 8);
  return m;
}

bool from_buffer_protocol(py::handle obj, Py_buffer* view, const char* what) {
  if (!PyObject_CheckBuffer(obj.ptr())) return false;
  if (PyObject_GetBuffer(obj.ptr(), view, PyBUF_RECORDS_RO) != 0) throw py::error_already_set();
  if (!PyBuffer_IsContiguous(view, 'A')) {
    PyBuffer_Release(view);
    throw_buffer_error(
        what, fmt::format("{}: not contiguous, so its memory is not one range", type_name(obj)),
        "pass a contiguous copy (numpy.ascontiguousarray, bytes(memoryview))");
  }
  return true;
}

MemoryOf view_memory(const Py_buffer& view) {
  MemoryOf m;
  m.addr = view.buf;
  m.nbytes = static_cast<std::size_t>(view.len);
  m.readonly = view.readonly != 0;
  return m;
}

[[noreturn]] void no_memory(py::handle obj, const char* what) {
  throw_buffer_error(what, fmt::format("{}: has neither the buffer protocol nor __dlpack__",
                                       type_name(obj)),
                     "pass a bytearray, memoryview, mmap, numpy array or torch tensor, or an "
                     "rdmakit.Buffer");
}

}  // namespace

const char* to_string(MemoryPlace place) noexcept {
  switch (place) {
    case MemoryPlace::host:
      return "host";
    case MemoryPlace::cuda:
      return "cuda";
    case MemoryPlace::cuda_host:
      return "cuda-host";
    case MemoryPlace::dmabuf:
      return "dmabuf";
  }
  return "?";
}

void throw_buffer_error(const char* op, const std::string& message, const std::string& hint) {
  throw KindedError(ErrorKind::buffer, op, EINVAL, message, hint);
}

std::unique_ptr<HeldMemory> HeldMemory::take(py::handle obj, const char* what) {
  std::unique_ptr<HeldMemory> h(new HeldMemory());
  h->obj_ = py::reinterpret_borrow<py::object>(obj);
  if (from_buffer_protocol(obj, &h->view_, what)) {
    h->has_view_ = true;
    h->mem_ = view_memory(h->view_);
    return h;
  }
  if (!py::hasattr(obj, "__dlpack__")) no_memory(obj, what);
  py::object capsule = obj.attr("__dlpack__")();
  auto* dl = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (dl == nullptr) throw py::error_already_set();
  // Renamed, the capsule no longer frees the tensor when it goes: it is ours to release.
  if (PyCapsule_SetName(capsule.ptr(), "used_dltensor") != 0) throw py::error_already_set();
  h->dl_ = dl;
  h->mem_ = dl_memory(dl->dl_tensor, obj, what);
  return h;
}

HeldMemory::~HeldMemory() {
  if (has_view_) PyBuffer_Release(&view_);
  if (dl_ != nullptr && dl_->deleter != nullptr) dl_->deleter(dl_);
}

MemoryOf memory_of(py::handle obj, const char* what) {
  Py_buffer view{};
  if (from_buffer_protocol(obj, &view, what)) {
    MemoryOf m = view_memory(view);
    PyBuffer_Release(&view);
    return m;
  }
  // A torch tensor answers these directly, without building a DLPack capsule.
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "is_contiguous") &&
      py::hasattr(obj, "element_size") && py::hasattr(obj, "numel")) {
    if (!obj.attr("is_contiguous")().cast<bool>()) {
      throw_buffer_error(
          what, fmt::format("{}: not contiguous, so its memory is not one range", type_name(obj)),
          "pass a contiguous copy (.contiguous())");
    }
    MemoryOf m;
    m.addr = reinterpret_cast<void*>(obj.attr("data_ptr")().cast<std::uintptr_t>());
    m.nbytes = obj.attr("numel")().cast<std::size_t>() * obj.attr("element_size")().cast<std::size_t>();
    // Where the bytes are, as the DLPack path says it (a pinned host tensor is host memory there
    // too): a CUDA tensor's device pointer is no CPU address.
    if (py::hasattr(obj, "is_cuda") && obj.attr("is_cuda").cast<bool>()) {
      m.place = MemoryPlace::cuda;
      m.device = obj.attr("get_device")().cast<int>();
    }
    return m;
  }
  if (!py::hasattr(obj, "__dlpack__")) no_memory(obj, what);
  return HeldMemory::take(obj, what)->memory();
}

std::uint64_t local_range(const char* op, std::uint64_t size, std::uint64_t offset,
                          std::optional<std::uint64_t> length,
                          std::optional<std::uint64_t> fallback) {
  if (offset > size) {
    throw_buffer_error(op, fmt::format("local_offset {} is past the local memory's {} bytes",
                                       offset, size));
  }
  const std::uint64_t n = length.value_or(fallback.value_or(size - offset));
  if (n > size - offset) {
    throw_buffer_error(op, fmt::format("length {} from local_offset {} passes the local memory's "
                                       "{} bytes",
                                       n, offset, size));
  }
  return n;
}

void refuse_remote_writes(const char* op, const std::string& subject, bool readonly,
                          Access access, const std::string& letters) {
  if (!readonly || !(allows(access, Access::remote_write) || allows(access, Access::remote_atomic))) {
    return;
  }
  throw_buffer_error(op, fmt::format("{} is read-only, so peers may not be given access \"{}\"",
                                     subject, letters),
                     "give access \"r\", or use a writable object");
}

}  // namespace rdmakit::python
