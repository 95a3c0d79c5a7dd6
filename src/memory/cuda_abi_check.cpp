// SPDX-License-Identifier: Apache-2.0
// Compiled only where the CUDA toolkit's cuda.h is installed: checks that the types, constants
// and symbols cuda.cpp loads at run time are the driver API's.
#include <cuda.h>

#include <type_traits>

#include "memory/cuda.hpp"

namespace rdmakit::detail::cuda {
static_assert(std::is_same_v<DevicePtr, CUdeviceptr>);
static_assert(std::is_same_v<Device, CUdevice>);
static_assert(std::is_same_v<Context, CUcontext> || sizeof(Context) == sizeof(CUcontext));
static_assert(sizeof(Result) == sizeof(CUresult) && kSuccess == CUDA_SUCCESS);
static_assert(kRangeHandleDmaBufFd == CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD);
static_assert(kHostAllocPortable == CU_MEMHOSTALLOC_PORTABLE);
static_assert(kPointerMemoryType == CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
static_assert(kPointerDeviceOrdinal == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
static_assert(kPointerRangeStart == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR);
static_assert(kPointerRangeSize == CU_POINTER_ATTRIBUTE_RANGE_SIZE);
static_assert(kMemoryTypeDevice == CU_MEMORYTYPE_DEVICE);
static_assert(std::is_same_v<decltype(&::cuPointerGetAttribute), CUresult (*)(void*, CUpointer_attribute, CUdeviceptr)>);
// The versioned symbols dlsym asks for exist with these signatures.
[[maybe_unused]] constexpr auto alloc = &::cuMemAlloc_v2;
[[maybe_unused]] constexpr auto dtoh = &::cuMemcpyDtoH_v2;
[[maybe_unused]] constexpr auto htod = &::cuMemcpyHtoD_v2;
[[maybe_unused]] constexpr auto release = &::cuDevicePrimaryCtxRelease_v2;
[[maybe_unused]] constexpr auto handle = &::cuMemGetHandleForAddressRange;
[[maybe_unused]] constexpr auto push = &::cuCtxPushCurrent_v2;
[[maybe_unused]] constexpr auto pop = &::cuCtxPopCurrent_v2;
[[maybe_unused]] constexpr auto memset8 = &::cuMemsetD8_v2;
[[maybe_unused]] constexpr auto sync = &::cuCtxSynchronize;
static_assert(std::is_same_v<decltype(&::cuCtxPushCurrent_v2), CUresult (*)(CUcontext)>);
static_assert(std::is_same_v<decltype(&::cuCtxPopCurrent_v2), CUresult (*)(CUcontext*)>);
static_assert(std::is_same_v<decltype(&::cuMemsetD8_v2), CUresult (*)(CUdeviceptr, unsigned char, size_t)>);
static_assert(std::is_same_v<decltype(&::cuMemAlloc_v2), CUresult (*)(CUdeviceptr*, size_t)>);
static_assert(std::is_same_v<decltype(&::cuDeviceGetPCIBusId), CUresult (*)(char*, int, CUdevice)>);
}  // namespace rdmakit::detail::cuda
