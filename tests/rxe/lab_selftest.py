#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Self-tests of lab/rdmakit-lab, one case per invocation (CTest runs each as its own test).

Every case runs the real lab: qemu, the guest kernel, rdma_rxe, and the host's rdma-core tools.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import time

LAB = "lab/rdmakit-lab"


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def lab_qemus():
    """pids of live (non-zombie) qemu processes started by any rdmakit-lab."""
    pids = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if argv and argv[0].endswith(b"qemu-system-x86_64") and state != "Z" and \
                any(a.startswith(b"rdmakit-lab-") for a in argv):
            pids.add(int(pid))
    return pids


def run_lab(args, timeout=300, env=None):
    """Runs the lab, echoing its output; returns (rc, stdout, stderr, seconds)."""
    t0 = time.monotonic()
    p = subprocess.run([LAB, "run", *args], capture_output=True, text=True, timeout=timeout, env=env)
    dt = time.monotonic() - t0
    sys.stdout.write(p.stdout)
    sys.stdout.write(p.stderr)
    print(f"-- lab exited {p.returncode} after {dt:.1f} s", flush=True)
    return p.returncode, p.stdout, p.stderr, dt


def expect_no_qemu_left(before, within=5.0):
    deadline = time.monotonic() + within
    while True:
        left = lab_qemus() - before
        if not left:
            return
        if time.monotonic() > deadline:
            fail(f"qemu processes outlived the lab: {sorted(left)}")
        time.sleep(0.1)


# A pingpong client: it retries until the server listens (it cannot know when that is).
PINGPONG_CLIENT = ("for i in $(seq 40); do ibv_rc_pingpong -d $RDMAKIT_LAB_DEVICE -g 1 -n 200 {host}"
                   " && exit 0; sleep 0.25; done; exit 1")


# --nics 2: every VM has eth0/rxe0 on 198.18.0.0/24 and eth1/rxe1 on 198.18.1.0/24, separate
# networks. VM 1 first checks its own device alone (ibv_devinfo, a pingpong over its own rxe0:
# server and client in one guest), then RC traffic crosses on rxe1 alone; then VM 1 takes eth1
# down: rxe1's port leaves ACTIVE while rxe0 stays up and still carries a pingpong with VM 0 (a
# rail can fail alone). The other suites run in one VM, two and three: the lab's VM counts.
def case_two_nics_two_vms():
    one_vm = ("ibv_devinfo -d rxe0 -v || exit 4; "
              "ibv_rc_pingpong -d rxe0 -g 1 -n 200 > /tmp/server.out 2>&1 & server=$!; "
              "(" + PINGPONG_CLIENT.replace("$RDMAKIT_LAB_DEVICE", "rxe0").format(host="127.0.0.1")
              + ") || exit 5; wait $server || exit 6; sed 's/^/loopback server: /' /tmp/server.out; ")
    script = ('set -- $RDMAKIT_LAB_IPS1; b=$1; set -- $RDMAKIT_LAB_IPS0; a=$1; '
              'echo "devices: $RDMAKIT_LAB_DEVICES ($RDMAKIT_LAB_NICS NICs), eth1 $RDMAKIT_LAB_IP1"; '
              'if [ "$RDMAKIT_LAB_INDEX" = 0 ]; then '
              "ibv_rc_pingpong -d rxe1 -g 1 -n 200 && exec ibv_rc_pingpong -d rxe0 -g 1 -n 200; else "
              + one_vm + "(" + PINGPONG_CLIENT.replace("$RDMAKIT_LAB_DEVICE", "rxe1").format(host="$b") + ") || exit 1; "
              "ip link set eth1 down; i=0; "
              "while grep -q ACTIVE /sys/class/infiniband/rxe1/ports/1/state; do "
              "i=$((i + 1)); [ $i -gt 50 ] && { echo 'rxe1 still ACTIVE 5 s after eth1 went down'; exit 2; }; "
              "sleep 0.1; done; echo \"rxe1 after eth1 down: $(cat /sys/class/infiniband/rxe1/ports/1/state)\"; "
              "grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state || { echo 'rxe0 went down too'; exit 3; }; "
              + PINGPONG_CLIENT.replace("$RDMAKIT_LAB_DEVICE", "rxe0").format(host="$a") + "; fi")
    rc, out, _, _ = run_lab(["--vms", "2", "--nics", "2", "--timeout", "180", "--", "sh", "-c", script])
    if rc != 0:
        fail(f"lab exited {rc}")
    if not re.search(r"^\[1\] devices: rxe0 rxe1 \(2 NICs\), eth1 198\.18\.1\.2$", out, re.M):
        fail("VM 1 did not see two NICs with rxe0 and rxe1, eth1 on 198.18.1.0/24")
    if not re.search(r"^\[1\]\s+state:\s+PORT_ACTIVE", out, re.M):
        fail("ibv_devinfo did not show an ACTIVE port")
    if not re.search(r"^\[1\]\s+GID\[\s*1\]:\s+::ffff:198\.18\.0\.2, RoCE v2", out, re.M):
        fail("GID 1 of rxe0 is not the RoCE v2 IPv4-mapped address")
    # The loopback pingpong's two sides both report: the client, and the server (server.out).
    if not re.search(r"^\[1\] loopback server: 200 iters in", out, re.M):
        fail("the one-guest pingpong's server did not report 200 iterations")
    for vm, peer in ((0, "198.18.1.2"), (1, "198.18.1.1"), (0, "198.18.0.2"), (1, "198.18.0.1")):
        if not re.search(rf"^\[{vm}\]\s+remote address: .*GID ::ffff:{re.escape(peer)}$", out, re.M):
            fail(f"VM {vm} did not run a pingpong with {peer} over RoCE v2")
    if not re.search(r"^\[1\] rxe1 after eth1 down: \d+: DOWN", out, re.M):
        fail("rxe1's port did not go DOWN with eth1")


def case_exit_status():
    # With two VMs, the failing one's status is the lab's (and reported), the other still finishes.
    # In the same boot: each guest kernel was given the host's TSC rate and took it (its
    # "Detected" line is that rate to the kHz), not left to calibrate it.
    rc, out, err, _ = run_lab(["--vms", "2", "--", "sh", "-c",
                               'echo about to end; cat /proc/cmdline; dmesg | grep "tsc: Detected"; '
                               'exit $((RDMAKIT_LAB_INDEX * 3))'])
    if rc != 3:
        fail(f"VM 1 exiting 3 gave lab status {rc}")
    if "VM 1: command exited with status 3" not in err:
        fail(f"the lab did not report the guest's status: {err[-300:]}")
    if "TSC rate could not be measured" in err:
        print("(this host's TSC rate cannot be measured: the guests calibrate it, as the lab said)")
    else:
        for vm in ("0", "1"):
            given = re.findall(rf"^\[{vm}\] .*\btsc_early_khz=(\d+)\b", out, re.M)
            if len(given) != 1:
                fail(f"VM {vm}'s kernel was not given the host's TSC rate: {out[-400:]}")
            mhz = f"{int(given[0]) // 1000}.{int(given[0]) % 1000:03d} MHz"
            if not re.search(rf"^\[{vm}\] .*tsc: Detected {re.escape(mhz)}", out, re.M):
                fail(f"VM {vm}'s kernel did not take the TSC rate it was given ({mhz}): {out[-600:]}")
    if "clock ran" in err:
        fail(f"a clock fault reported with the host's TSC rate given: {err[-400:]}")


def case_clock():
    # A guest given half the TSC's real rate (the kernel's refinement corrects 1% at most) counts
    # two seconds for each of the host's: the lab says so, and how fast, naming the VM.
    rc, out, err, _ = run_lab(["--", "sh", "-c", "grep -o 'tsc_early_khz=[0-9]*' /proc/cmdline"])
    if "TSC rate could not be measured" in err:
        print("(this host's TSC rate cannot be measured: nothing to halve)")
        return
    if rc != 0 or not re.search(r"tsc_early_khz=(\d+)", out):
        fail(f"no TSC rate given to the guest: status {rc}, {out[-300:]}")
    real = int(re.search(r"tsc_early_khz=(\d+)", out).group(1))
    rc, _, err, _ = run_lab(["--", "sh", "-c", "sleep 10"], env=dict(os.environ, RDMAKIT_LAB_TSC_KHZ=str(real // 2)))
    m = re.search(r"VM 0's clock ran ([0-9.]+)x as fast as the host's", err)
    if rc != 0 or not m:
        fail(f"a guest clock at twice the host's rate was not reported (status {rc})")
    if not 1.6 <= float(m.group(1)) <= 2.4:
        fail(f"the guest's clock reported at {m.group(1)}x the host's, not about 2x")
    rc, _, err, _ = run_lab(["--", "true"], timeout=60, env=dict(os.environ, RDMAKIT_LAB_TSC_KHZ="12x"))
    if rc != 125 or "RDMAKIT_LAB_TSC_KHZ=12x" not in err:
        fail(f"a malformed RDMAKIT_LAB_TSC_KHZ gave status {rc}: {err[-200:]}")


def case_cpus_refused():
    # --cpus: a list that is not one is refused before anything boots.
    for bad in ("x", "3-1", "0,", "\u00b2", "1000000", "0-2000000000"):
        rc, _, err, _ = run_lab(["--cpus", bad, "--", "true"], timeout=30)
        if rc != 125 or f"--cpus {bad}" not in err:
            fail(f"--cpus {bad!r} gave status {rc}: {err[-200:]}")


def case_cpus():
    # A VM held to one CPU runs there (its qemu's affinity, read while it runs), with one vCPU by
    # default; "all" takes back every CPU for a caller held to fewer.
    # Every CPU there is (whoever runs this case may have held it to some; it runs alone).
    os.sched_setaffinity(0, range(os.sysconf("SC_NPROCESSORS_CONF")))
    cpus = sorted(os.sched_getaffinity(0))
    before = lab_qemus()
    p = subprocess.Popen([LAB, "run", "--timeout", "60", "--cpus", str(cpus[-1]), "--", "sh", "-c", "nproc; sleep 4"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = set()
    try:
        deadline = time.monotonic() + 300
        while p.poll() is None and time.monotonic() < deadline:
            for pid in lab_qemus() - before:
                try:
                    seen.add(frozenset(os.sched_getaffinity(pid)))
                except OSError:
                    pass
            time.sleep(0.5)
        out = p.communicate(timeout=30)[0]
    finally:
        p.kill()
    sys.stdout.write(out)
    if p.returncode != 0:
        fail(f"the held run exited {p.returncode}")
    if seen != {frozenset({cpus[-1]})}:
        fail(f"qemu ran on {[sorted(s) for s in seen]}, not on CPU {cpus[-1]} alone")
    if not re.search(r"^1$", out, re.M):
        fail("a VM held to one CPU did not get one vCPU by default")
    if len(cpus) > 1:
        # (Two CPUs at most: a guest of many vCPUs boots slowly under emulation.)
        spec = "all" if len(cpus) == 2 else f"{cpus[0]},{cpus[1]}"
        held = subprocess.run(["taskset", "-c", str(cpus[0]), LAB, "run", "--timeout", "60", "--cpus", spec,
                               "--", "nproc"], capture_output=True, text=True, timeout=300)
        sys.stdout.write(held.stdout + held.stderr)
        if held.returncode != 0 or not re.search(r"^2$", held.stdout, re.M):
            fail(f"--cpus {spec} under a caller held to CPU {cpus[0]} did not give 2 vCPUs")
    expect_no_qemu_left(before)


def case_timeout():
    before = lab_qemus()
    t0 = time.monotonic()
    p = subprocess.Popen([LAB, "run", "-v", "--timeout", "5", "--", "sleep", "600"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = None
    for line in p.stdout:
        sys.stdout.write(line)
        if "starting the command" in line:
            started = time.monotonic()
    rc = p.wait(timeout=60)
    end = time.monotonic()
    print(f"-- lab exited {rc}, {end - t0:.1f} s in all", flush=True)
    if started is None:
        fail("the guest never started the command")
    if rc != 124:
        fail(f"expected exit status 124 after a timeout, got {rc}")
    late = end - started - 5
    print(f"-- killed {late:.2f} s after the 5 s timeout", flush=True)
    if late > 3:
        fail(f"killed {late:.1f} s after the timeout (allowed: 3 s)")
    expect_no_qemu_left(before)


def case_boot_timeout():
    before = lab_qemus()
    rc, _, err, dt = run_lab(["--boot-timeout", "1", "--", "true"])
    if rc != 125:
        fail(f"a guest that cannot boot in time gave status {rc}, expected 125")
    if "--boot-timeout" not in err:
        fail("the lab did not say the guest missed its boot deadline")
    if "the boot's last step:" not in err:
        fail("the lab did not say how far the guest's boot got")
    if dt > 15:
        fail(f"took {dt:.1f} s to give up on a 1 s boot deadline")
    expect_no_qemu_left(before)


def case_panic():
    before = lab_qemus()
    # sysrq 'c' crashes the guest kernel on purpose.
    rc, _, err, _ = run_lab(["--", "sh", "-c", "echo c > /proc/sysrq-trigger; sleep 60"])
    if rc != 125:
        fail(f"a guest kernel panic gave status {rc}, expected 125")
    if "panicked" not in err:
        fail("the lab did not report the panic")
    expect_no_qemu_left(before)


def _signal_case(sig, expect_rc):
    before = lab_qemus()
    p = subprocess.Popen([LAB, "run", "-v", "--vms", "2", "--", "sleep", "600"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        sys.stdout.write(line)
        if "starting the command" in line:
            break
    else:
        fail("the guests never started the command")
    if len(lab_qemus() - before) != 2:
        fail("expected two running qemu processes")
    p.send_signal(sig)
    rest, _ = p.communicate(timeout=30)
    sys.stdout.write(rest)
    print(f"-- lab exited {p.returncode} after {signal.Signals(sig).name}", flush=True)
    if expect_rc is not None and p.returncode != expect_rc:
        fail(f"expected status {expect_rc}, got {p.returncode}")
    expect_no_qemu_left(before)


def case_sigterm():
    _signal_case(signal.SIGTERM, 128 + signal.SIGTERM)


def case_sigkill():
    # The lab cannot clean up after SIGKILL; the kernel must (PR_SET_PDEATHSIG on each qemu).
    _signal_case(signal.SIGKILL, -signal.SIGKILL)


def main():
    global LAB
    ap = argparse.ArgumentParser()
    ap.add_argument("--lab", default=LAB)
    ap.add_argument("case", choices=[n[5:] for n in globals() if n.startswith("case_")])
    a = ap.parse_args()
    LAB = a.lab
    globals()["case_" + a.case]()
    print(f"PASS: {a.case}")


if __name__ == "__main__":
    main()
