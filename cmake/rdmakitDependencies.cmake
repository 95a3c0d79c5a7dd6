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

# A library that is private to rdmakit but that a static librdmakit needs at link time, as an
# imported target, so the build and the installed config find it alike.
#   _rdmakit_import(TARGET HEADER LIBRARY DEBIAN_PACKAGE)
function(_rdmakit_import target header library package)
  if(TARGET ${target})
    return()
  endif()
  string(TOUPPER "${library}" name)
  find_path(RDMAKIT_${name}_INCLUDE_DIR ${header})
  find_library(RDMAKIT_${name}_LIBRARY ${library})
  if(NOT RDMAKIT_${name}_INCLUDE_DIR OR NOT RDMAKIT_${name}_LIBRARY)
    message(FATAL_ERROR "rdmakit needs ${library} (apt-get install ${package})")
  endif()
  add_library(${target} UNKNOWN IMPORTED)
  set_target_properties(${target} PROPERTIES
    IMPORTED_LOCATION ${RDMAKIT_${name}_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${RDMAKIT_${name}_INCLUDE_DIR})
endfunction()

# libsodium: the authenticated bootstrap's HMAC-SHA256, nonces, constant-time compare.
_rdmakit_import(rdmakit::sodium sodium.h sodium libsodium-dev)
# hiredis and libcurl: the metadata plane's Redis and etcd clients.
_rdmakit_import(rdmakit::hiredis hiredis/hiredis.h hiredis libhiredis-dev)
_rdmakit_import(rdmakit::curl curl/curl.h curl libcurl4-openssl-dev)
# cpp-httplib: MetricsServer's HTTP server and the stats command's client. Debian's is a
# compiled library whose classes depend on the features it was built with (TLS, compression):
# its pkg-config flags are ours too.
if(NOT TARGET rdmakit::httplib)
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(RDMAKIT_HTTPLIB REQUIRED IMPORTED_TARGET GLOBAL cpp-httplib)
  add_library(rdmakit::httplib ALIAS PkgConfig::RDMAKIT_HTTPLIB)
endif()
