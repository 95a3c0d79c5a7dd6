# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures. The tests in unit/ need no RDMA device; those in rxe/ run inside the lab
(tests/rxe/CMakeLists.txt runs them in a VM), where rxe0 is up."""
