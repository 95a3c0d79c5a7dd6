// SPDX-License-Identifier: Apache-2.0
#include "metadata/store.hpp"

#include <cerrno>

namespace rdmakit::detail::metadata {

std::unique_ptr<Store> open_store(const StoreUri& uri) {
  switch (uri.kind) {
    case StoreUri::Kind::redis:
      return open_redis(uri);
    case StoreUri::Kind::etcd:
      return open_etcd(uri);
    case StoreUri::Kind::p2p:
      break;
  }
  throw Error("metadata store", EINVAL, "p2p has no store", "use a redis:// or etcd:// URI");
}

}  // namespace rdmakit::detail::metadata
