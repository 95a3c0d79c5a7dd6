# rdma-core's libraries as imported targets. Used by the build and by the installed package
# config alike, so a consumer of find_package(rdmakit) resolves them the same way.
if(NOT TARGET rdmakit::ibverbs)
  find_path(RDMAKIT_IBVERBS_INCLUDE_DIR infiniband/verbs.h)
  find_library(RDMAKIT_IBVERBS_LIBRARY ibverbs)
  find_path(RDMAKIT_RDMACM_INCLUDE_DIR rdma/rdma_cma.h)
  find_library(RDMAKIT_RDMACM_LIBRARY rdmacm)
  foreach(var RDMAKIT_IBVERBS_INCLUDE_DIR RDMAKIT_IBVERBS_LIBRARY
              RDMAKIT_RDMACM_INCLUDE_DIR RDMAKIT_RDMACM_LIBRARY)
    if(NOT ${var})
      message(FATAL_ERROR "rdmakit needs rdma-core's development files (${var} not found): "
                          "apt-get install libibverbs-dev librdmacm-dev")
    endif()
  endforeach()
  add_library(rdmakit::ibverbs UNKNOWN IMPORTED)
  set_target_properties(rdmakit::ibverbs PROPERTIES
    IMPORTED_LOCATION ${RDMAKIT_IBVERBS_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${RDMAKIT_IBVERBS_INCLUDE_DIR})
  add_library(rdmakit::rdmacm UNKNOWN IMPORTED)
  set_target_properties(rdmakit::rdmacm PROPERTIES
    IMPORTED_LOCATION ${RDMAKIT_RDMACM_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${RDMAKIT_RDMACM_INCLUDE_DIR}
    INTERFACE_LINK_LIBRARIES rdmakit::ibverbs)
endif()

# libsodium (the authenticated bootstrap's HMAC-SHA256, nonces, constant-time compare): private to
# the library, but a static librdmakit needs it at link time, so the installed config finds it too.
if(NOT TARGET rdmakit::sodium)
  find_path(RDMAKIT_SODIUM_INCLUDE_DIR sodium.h)
  find_library(RDMAKIT_SODIUM_LIBRARY sodium)
  if(NOT RDMAKIT_SODIUM_INCLUDE_DIR OR NOT RDMAKIT_SODIUM_LIBRARY)
    message(FATAL_ERROR "rdmakit needs libsodium (apt-get install libsodium-dev)")
  endif()
  add_library(rdmakit::sodium UNKNOWN IMPORTED)
  set_target_properties(rdmakit::sodium PROPERTIES
    IMPORTED_LOCATION ${RDMAKIT_SODIUM_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${RDMAKIT_SODIUM_INCLUDE_DIR})
endif()
