# SPDX-License-Identifier: Apache-2.0
"""The library's log lines reach Python's logging (logger "rdmakit"), from whichever thread said
them, without the process's stderr in between."""
import logging
import time

import rdmakit


def test_a_keyless_listener_is_logged_to_the_rdmakit_logger():
    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record)

    h = Keep()
    log = logging.getLogger("rdmakit")
    log.addHandler(h)
    try:
        e = rdmakit.Engine(name="logged", listen="127.0.0.1:0", transports=["tcp"])
        port = e.port
        until = time.monotonic() + 5
        while time.monotonic() < until and not any("without a pre-shared key" in r.getMessage() for r in got):
            time.sleep(0.01)
        e.close()
    finally:
        log.removeHandler(h)
    lines = [r for r in got if "without a pre-shared key" in r.getMessage()]
    assert lines, [r.getMessage() for r in got]
    assert lines[0].name == "rdmakit" and lines[0].levelno == logging.WARNING
    assert f"listening on port {port} without a pre-shared key" in lines[0].getMessage()
    assert not lines[0].getMessage().startswith("rdmakit:")   # the logger's name says it


def test_importing_starts_no_thread_and_a_forked_child_logs_its_own():
    import os
    import subprocess
    import sys
    code = """
import logging, os, sys, threading, time
import rdmakit
assert threading.active_count() == 1, threading.enumerate()      # import alone starts none
got = []
class Keep(logging.Handler):
    def emit(self, r): got.append(r.getMessage())
logging.getLogger("rdmakit").addHandler(Keep())
e = rdmakit.Engine(name="p", listen="127.0.0.1:0", transports=["tcp"])
pid = os.fork()
if pid == 0:
    c = rdmakit.Engine(name="c", listen="127.0.0.1:0", transports=["tcp"])
    port = c.port
    until = time.monotonic() + 5
    while time.monotonic() < until and not any(f"port {port} " in g for g in got):
        time.sleep(0.01)
    os._exit(0 if any(f"port {port} " in g for g in got) else 3)
_, status = os.waitpid(pid, 0)
e.close()
sys.exit(os.waitstatus_to_exitcode(status))
"""
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
