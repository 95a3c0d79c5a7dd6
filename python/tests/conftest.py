# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures. The tests in unit/ need no RDMA device; those in rxe/ run inside the lab
(tests/rxe/CMakeLists.txt runs them in a VM), where rxe0 is up."""


def pytest_configure(config):
    # tests/rxe/CMakeLists.txt runs these on one lab VM and the rest on the other: importing torch
    # takes 23 s of a TCG guest's CPU, as much as all the other tests there together.
    config.addinivalue_line("markers", "torch: imports torch")
