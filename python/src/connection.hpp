// SPDX-License-Identifier: Apache-2.0
// rdmakit.connect, rdmakit.Listener and rdmakit.Connection.
#pragma once

#include <pybind11/pybind11.h>

namespace rdmakit::python {

void bind_connection(pybind11::module_& m);

}  // namespace rdmakit::python
