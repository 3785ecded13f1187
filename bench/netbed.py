"""A slow-network test bed on one machine: K hosts in network namespaces behind a shaped bridge.

Why: the point of sparse gradient exchange is to send fewer bytes over links slower than the
compute. On one machine every collective runs over loopback at memory speed, which hides exactly
the effect we want to measure. This module builds K "hosts" (2-4), each a network namespace with
its own address 10.77.0.(i+1)/24, joined by veth pairs to a bridge that lives in a namespace of its
own (the root namespace is never touched), and limits every link with `tc tbf` in both directions
(a full-duplex link of the given rate). Commands then run inside each host with the environment
that gloo and torchrun need (MASTER_ADDR, GLOO_SOCKET_IFNAME, ...).

What it cannot do: emulate latency. `netem` (and fq/fq_codel/cake) are unknown to this kernel, so
the bed has the bandwidth of a real link but the latency of a veth (tens of microseconds).
Benchmarks model latency instead: t + rounds * latency (see bench/allreduce_bench.py).

Library:
    with NetBed(hosts=2, bandwidth="100mbit") as bed:
        result = bed.run("python bench/allreduce_bench.py", timeout=300)
CLI:
    python bench/netbed.py check
    python bench/netbed.py run --hosts 2 --bandwidth 100mbit -- python bench/allreduce_bench.py
    python bench/netbed.py throughput --bandwidth 100mbit      # raw TCP rate through one link
    python bench/netbed.py cleanup                             # remove beds of dead processes

Needs root (network namespaces, tc). Everything is named "nmtbed-<pid>-..." after the process that
owns it, so several beds can coexist; beds left behind by killed processes are removed on the next
start (or with `cleanup`).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

PREFIX = "nmtbed-"
SUBNET = "10.77.0"  # private /24, only ever used inside namespaces this module creates
HOST_IFNAME = "nbveth0"  # the veth end inside each host namespace (names are per namespace)
BRIDGE = "nbbr0"
DEFAULT_MASTER_PORT = 29500
QUEUE_MS = 10  # tbf queue: how long a packet may wait before it is dropped (keeps bufferbloat low)

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(text: str) -> int | None:
    """Parse a tc-style rate ("100mbit", "1gbit", "500kbit", "2.5gbit") into bits per second.

    Args:
        text: the rate; "unlimited" (or "none", "0") means no shaping.

    Returns:
        Bits per second, or None for unlimited.
    """
    value = text.strip().lower()
    if value in ("unlimited", "none", "0", ""):
        return None
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit|tbit)", value)
    if not match:
        raise ValueError(
            f"bandwidth {text!r} is not understood: use a tc-style rate such as 100mbit, 1gbit, "
            f"500kbit, or 'unlimited'"
        )
    bps = int(float(match.group(1)) * _RATE_UNITS[match.group(2)])
    if bps < 10**5:
        raise ValueError(f"bandwidth {text!r} is below 100kbit; the bed is not made for that")
    return bps


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one setup command (ip/tc) and raise with its stderr if it fails."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces that start with `prefix`."""
    out = _sh("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [name for name in names if name.startswith(prefix)]


def list_root_links(prefix: str = PREFIX) -> list[str]:
    """Links in the root namespace whose name starts with `prefix` (the bed never creates any)."""
    out = _sh("ip", "-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [name for name in names if name.startswith(prefix)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_namespace(name: str) -> None:
    """Kill whatever still runs inside namespace `name` (all started by a bed), then delete it.

    Deleting a namespace deletes the veths and the bridge inside it, so nothing else is left.
    """
    pids = _sh("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _sh("ip", "netns", "del", name, check=False)


def cleanup_stale(everything: bool = False) -> list[str]:
    """Delete beds whose owning process is gone (or all beds with `everything`), and their processes.

    Returns:
        The namespaces that were deleted.
    """
    removed = []
    for name in list_namespaces(PREFIX):
        match = re.match(rf"{re.escape(PREFIX)}(\d+)-", name)
        owner = int(match.group(1)) if match else None
        if everything or owner is None or not _pid_alive(owner):
            delete_namespace(name)
            removed.append(name)
    return removed


@dataclass
class HostResult:
    """How one process on one host ended."""

    host: int
    proc: int
    returncode: int
    log: Path


@dataclass
class RunResult:
    """How a command ran across the bed: one HostResult per process, and whether it timed out."""

    results: list[HostResult] = field(default_factory=list)
    timed_out: bool = False
    log_dir: Path = Path(".")
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.results)

    @property
    def returncode(self) -> int:
        if self.timed_out:
            return 124
        # Prefer a process that failed on its own (>0) over peers we killed afterwards (<0).
        codes = [r.returncode for r in self.results]
        return next((c for c in codes if c > 0), next((c for c in codes if c != 0), 0))


class NetBed:
    """K hosts in their own network namespaces, joined by a bridge, each link shaped with tbf.

    Args:
        hosts: number of hosts, 2-4 (a /24 would allow more; the CPU here does not).
        bandwidth: tc rate of every host link in each direction ("100mbit", "1gbit", "unlimited").
        master_port: port that host 0 offers for MASTER_PORT / the rendezvous.
        name: namespace prefix; default "nmtbed-<pid>" so concurrent beds never collide.
    """

    def __init__(
        self,
        hosts: int = 2,
        bandwidth: str = "unlimited",
        master_port: int = DEFAULT_MASTER_PORT,
        name: str | None = None,
    ) -> None:
        if not 2 <= hosts <= 16:
            raise ValueError(f"hosts={hosts}: use 2-4 hosts (at most 16)")
        self.hosts = hosts
        self.bandwidth = bandwidth
        self.rate_bps = parse_rate(bandwidth)
        self.master_port = master_port
        self.name = name or f"{PREFIX}{os.getpid()}"
        if not self.name.startswith(PREFIX):
            raise ValueError(f"bed name {self.name!r} must start with {PREFIX!r} so cleanup can find it")
        self.bridge_ns = f"{self.name}-br"
        self._up = False
        self._children: list[subprocess.Popen[bytes]] = []

    # ----- topology ---------------------------------------------------------------------------
    def host_ns(self, host: int) -> str:
        """Namespace name of host `host`."""
        return f"{self.name}-h{host}"

    def addr(self, host: int) -> str:
        """IPv4 address of host `host` (10.77.0.1 is host 0)."""
        return f"{SUBNET}.{host + 1}"

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_ns] + [self.host_ns(i) for i in range(self.hosts)]

    def up(self) -> None:
        """Create the bed (removing any stale bed of the same name first). Idempotent."""
        cleanup_stale()
        for ns in self.namespaces:
            if ns in list_namespaces(self.name):
                delete_namespace(ns)
        atexit.register(self.down)
        self._up = True
        try:
            self._create()
        except BaseException:
            self.down()
            raise

    def _create(self) -> None:
        br = self.bridge_ns
        _sh("ip", "netns", "add", br)
        _sh("ip", "-n", br, "link", "set", "lo", "up")
        _sh("ip", "-n", br, "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "-n", br, "link", "set", BRIDGE, "up")
        for i in range(self.hosts):
            ns, port = self.host_ns(i), f"nbport{i}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            # Both veth ends are born inside our namespaces: the root namespace never sees them.
            _sh("ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", HOST_IFNAME, "netns", ns)
            _sh("ip", "-n", br, "link", "set", port, "master", BRIDGE)
            _sh("ip", "-n", br, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", HOST_IFNAME)
            _sh("ip", "-n", ns, "link", "set", HOST_IFNAME, "up")
            if self.rate_bps is not None:
                # Host egress (what the host sends) and the bridge port's egress (what it receives):
                # a full-duplex link of the given rate.
                self._shape(ns, HOST_IFNAME)
                self._shape(br, port)

    def _shape(self, ns: str, dev: str) -> None:
        assert self.rate_bps is not None
        rate_bytes = self.rate_bps / 8
        # burst: ~2 ms at line rate, at least 32 KiB, so the token bucket (not the timer) sets the rate.
        burst = max(int(rate_bytes * 0.002), 32 * 1024)
        tbf = f"tbf rate {self.rate_bps}bit burst {burst} latency {QUEUE_MS}ms"
        _sh(*f"tc -n {ns} qdisc replace dev {dev} root {tbf}".split())

    def down(self) -> None:
        """Kill what runs in the bed and delete its namespaces (and so its veths and bridge)."""
        for child in self._children:
            _kill_group(child)
        self._children.clear()
        for ns in self.namespaces:
            delete_namespace(ns)  # also ends anything that escaped the process groups
        self._up = False
        atexit.unregister(self.down)

    def __enter__(self) -> NetBed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ----- running commands -------------------------------------------------------------------
    def host_env(self, host: int, proc: int = 0, procs_per_host: int = 1) -> dict[str, str]:
        """Environment for process `proc` on host `host`: netbed facts plus what gloo/torchrun need.

        RANK/WORLD_SIZE/LOCAL_RANK make a plain `init_process_group("gloo")` work without torchrun;
        torchrun overrides them for its own workers.
        """
        return {
            "NETBED_HOST": str(host),
            "NETBED_HOSTS": str(self.hosts),
            "NETBED_ADDR": self.addr(host),
            "NETBED_ADDRS": ",".join(self.addr(i) for i in range(self.hosts)),
            "NETBED_IFNAME": HOST_IFNAME,
            "NETBED_BANDWIDTH": self.bandwidth,
            "NETBED_BANDWIDTH_BPS": str(self.rate_bps or 0),
            "NETBED_PROCS_PER_HOST": str(procs_per_host),
            "NETBED_PROC": str(proc),
            "MASTER_ADDR": self.addr(0),
            "MASTER_PORT": str(self.master_port),
            "GLOO_SOCKET_IFNAME": HOST_IFNAME,
            "TP_SOCKET_IFNAME": HOST_IFNAME,  # torch.distributed.rpc (tensorpipe), used by the dgs trainer
            # torchrun's c10d rendezvous inside a bed needs both: host 0 must be told to host the
            # store (it cannot recognise 10.77.0.1 as its own hostname's address), and each agent
            # must advertise its bed address (not the shared hostname) as the workers' MASTER_ADDR.
            "NETBED_TORCHRUN_ARGS": (
                f"--rdzv-backend c10d --rdzv-endpoint {self.addr(0)}:{self.master_port} --rdzv-id netbed "
                f"--rdzv-conf is_host={int(host == 0)} --local-addr {self.addr(host)}"
            ),
            "RANK": str(host * procs_per_host + proc),
            "WORLD_SIZE": str(self.hosts * procs_per_host),
            "LOCAL_RANK": str(proc),
            "LOCAL_WORLD_SIZE": str(procs_per_host),
        }

    def exec_argv(self, host: int, command: str, env: dict[str, str]) -> list[str]:
        """The argv that runs shell `command` inside host `host` with `env` (expanded by bash there)."""
        assigns = [f"{key}={value}" for key, value in env.items()]
        return ["ip", "netns", "exec", self.host_ns(host), "env", *assigns, "bash", "-c", command]

    def run(
        self,
        command: str,
        procs_per_host: int = 1,
        timeout: float = 600.0,
        log_dir: str | Path | None = None,
        echo: str = "0",
        cwd: str | Path | None = None,
    ) -> RunResult:
        """Run shell `command` in every host (procs_per_host copies each) and wait for all of them.

        Args:
            command: a bash command line; $NETBED_HOST, $MASTER_ADDR, ... expand inside each host.
            procs_per_host: copies per host (RANK = host * procs_per_host + proc). With torchrun keep 1
                and use torchrun's --nproc-per-node instead.
            timeout: seconds for the whole run; on expiry every process is killed and the result
                says timed_out (returncode 124).
            log_dir: where host<i>-proc<j>.log files go; default a fresh directory under /tmp.
            echo: which hosts' output is also copied to stdout: "all", "none" or a host index.
            cwd: working directory of the command (default: the current one).

        Returns:
            A RunResult; `.ok` is False if any process failed or the run timed out.
        """
        if not self._up:
            raise RuntimeError("the bed is not up: call up() or use `with NetBed(...) as bed:`")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"netbed-{stamp}-"))
        logs.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        pumps: list[threading.Thread] = []
        procs: list[tuple[int, int, subprocess.Popen[bytes], Path]] = []
        for host in range(self.hosts):
            for proc in range(procs_per_host):
                env = self.host_env(host, proc, procs_per_host)
                argv = self.exec_argv(host, command, env)
                log = logs / f"host{host}-proc{proc}.log"
                child = subprocess.Popen(
                    argv,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=cwd,
                    start_new_session=True,
                )
                self._children.append(child)
                procs.append((host, proc, child, log))
                show = echo == "all" or echo == str(host)
                tag = f"[h{host}]" if procs_per_host == 1 else f"[h{host}.{proc}]"
                pump = threading.Thread(
                    target=_pump,
                    args=(child.stdout, log, tag if show else None, shlex.join(argv)),
                    daemon=True,
                )
                pump.start()
                pumps.append(pump)
        result = RunResult(log_dir=logs)
        deadline = started + timeout
        while True:
            codes = [child.poll() for _, _, child, _ in procs]  # poll every child: no short-circuit
            if all(code is not None for code in codes):
                break
            failed = any(code not in (None, 0) for code in codes)
            if time.monotonic() > deadline or failed:
                # A failed host usually leaves its peers blocked in a collective: end them too, now.
                result.timed_out = not failed
                grace = time.monotonic() + 5
                for _, _, child, _ in procs:
                    if child.poll() is None:
                        _kill_group(child, signal.SIGTERM, wait=max(0.1, grace - time.monotonic()))
                break
            time.sleep(0.05)
        for pump in pumps:
            pump.join(timeout=5)
        for host, proc, child, log in procs:
            child.wait()
            self._children.remove(child)
            result.results.append(HostResult(host, proc, child.returncode, log))
        result.seconds = time.monotonic() - started
        return result


def _pump(stream: IO[bytes] | None, log: Path, tag: str | None, header: str) -> None:
    """Copy a child's output into its log file (and to stdout with a host tag if asked)."""
    assert stream is not None
    with open(log, "wb") as out:
        out.write(f"# {header}\n".encode())
        for line in iter(stream.readline, b""):
            out.write(line)
            out.flush()
            if tag is not None:
                sys.stdout.write(f"{tag} {line.decode(errors='replace')}")
                sys.stdout.flush()


def _kill_group(child: subprocess.Popen[bytes], sig: int = signal.SIGTERM, wait: float = 5.0) -> None:
    """End the process group we started for `child` (it has its own session), escalating to SIGKILL."""
    if child.poll() is not None:
        return
    try:
        os.killpg(child.pid, sig)
        child.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    except ProcessLookupError:
        pass


# ----- check -------------------------------------------------------------------------------------
def check() -> tuple[bool, str]:
    """Whether namespaces, veths, a bridge and tbf work here, and whether a TCP byte crosses the bed.

    Returns:
        (ok, reason): reason explains a failure, or lists what works (and that netem does not).
    """
    if os.geteuid() != 0:
        return False, "not root: network namespaces and tc need root (run as root or skip the netbed)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found (install iproute2)"
    bed = NetBed(hosts=2, bandwidth="100mbit", name=f"{PREFIX}{os.getpid()}-chk")
    try:
        bed.up()
        netem = _sh(*f"tc -n {bed.host_ns(0)} qdisc add dev lo root netem delay 1ms".split(), check=False)
        probe = _tcp_probe_command(bed, nbytes=1 << 16)
        res = subprocess.run(probe, capture_output=True, text=True, timeout=20)
        if res.returncode != 0:
            return False, f"bed built but TCP across it failed: {res.stderr.strip()[-300:]}"
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        return False, f"cannot build a bed here: {exc}"
    finally:
        bed.down()
    latency = (
        "netem works (latency could be emulated)"
        if netem.returncode == 0
        else ("netem unavailable (latency is modelled, not emulated)")
    )
    return True, f"namespaces, veth, bridge, tbf and TCP across the bed work; {latency}"


_THROUGHPUT_SCRIPT = r"""
import socket, sys, time, subprocess
server_ns, addr, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
srv = subprocess.Popen(["ip", "netns", "exec", server_ns, sys.executable, "-c",
    "import socket,sys\n"
    "s=socket.create_server(('%s', 5201)); print('ready', flush=True); c,_=s.accept(); n=0\n"
    "while True:\n"
    "    b=c.recv(1<<20)\n"
    "    if not b: break\n"
    "    n+=len(b)\n"
    "c.sendall(str(n).encode()); c.close()\n" % addr], stdout=subprocess.PIPE, text=True)
assert srv.stdout.readline().strip() == "ready"
c = socket.create_connection((addr, 5201), timeout=60)
chunk = b"\0" * (1 << 20); sent = 0; t0 = time.perf_counter()
while sent < nbytes:
    c.sendall(chunk[: min(len(chunk), nbytes - sent)]); sent += min(len(chunk), nbytes - sent)
c.shutdown(socket.SHUT_WR); got = int(c.recv(64).decode()); dt = time.perf_counter() - t0
srv.wait(); assert got == nbytes, (got, nbytes)
print(f"{nbytes} {dt:.6f} {nbytes * 8 / dt / 1e6:.2f}")
"""


def _tcp_probe_command(bed: NetBed, nbytes: int) -> list[str]:
    """argv that sends `nbytes` over TCP from host 1 to host 0 and prints "bytes seconds Mbit/s"."""
    return [
        "ip",
        "netns",
        "exec",
        bed.host_ns(1),
        sys.executable,
        "-c",
        _THROUGHPUT_SCRIPT,
        bed.host_ns(0),
        bed.addr(0),
        str(nbytes),
    ]


def measure_throughput(bed: NetBed, nbytes: int) -> float:
    """Send `nbytes` over one TCP stream from host 1 to host 0; return the goodput in Mbit/s."""
    res = subprocess.run(_tcp_probe_command(bed, nbytes), capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"throughput probe failed: {res.stderr.strip()[-500:]}")
    return float(res.stdout.split()[2])


# ----- CLI ---------------------------------------------------------------------------------------
def _install_signal_handlers() -> None:
    """Turn SIGINT/SIGTERM/SIGHUP into SystemExit so `finally` and atexit tear the bed down.

    SIGINT is set explicitly: a shell starts background jobs with SIGINT ignored.
    """

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="can a bed be built here? exit 0/1 with the reason")
    clean = sub.add_parser("cleanup", help="delete beds left by dead processes")
    clean.add_argument("--all", action="store_true", help="delete every nmtbed-* namespace, live or not")
    for name in ("run", "throughput"):
        p = sub.add_parser(
            name,
            help="run COMMAND on every host" if name == "run" else "measure raw TCP goodput host1 -> host0",
        )
        p.add_argument("--hosts", type=int, default=2, help="number of hosts, 2-4 (default 2)")
        p.add_argument("--bandwidth", default="unlimited", help="per-link rate: 100mbit, 1gbit, unlimited")
        p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT)
    run = sub.choices["run"]
    run.add_argument("--procs-per-host", type=int, default=1, help="copies of COMMAND per host (RANK env)")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run (default 600)")
    run.add_argument("--log-dir", default=None, help="per-process logs (default: a new /tmp/netbed-* dir)")
    run.add_argument("--echo", default="0", help="hosts whose output goes to stdout: all, none, or an index")
    run.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- COMMAND ... (run with bash -c in each host)"
    )
    sub.choices["throughput"].add_argument(
        "--mbytes", type=float, default=20.0, help="MB to send (default 20)"
    )
    args = parser.parse_args(argv)

    if args.cmd == "check":
        ok, reason = check()
        print(("ok: " if ok else "unavailable: ") + reason)
        return 0 if ok else 1
    if args.cmd == "cleanup":
        removed = cleanup_stale(everything=args.all)
        print("removed: " + (" ".join(removed) if removed else "nothing"))
        return 0

    _install_signal_handlers()
    bed = NetBed(hosts=args.hosts, bandwidth=args.bandwidth, master_port=args.master_port)
    try:
        bed.up()
        if args.cmd == "throughput":
            mbit = measure_throughput(bed, int(args.mbytes * 1e6))
            print(f"TCP goodput host1 -> host0 at {args.bandwidth}: {mbit:.1f} Mbit/s")
            return 0
        words = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not words:
            parser.error("run needs a command after --")
        # Like ssh: words are joined with spaces and bash in the host expands them, so
        # '$NETBED_HOST' (quoted against the outer shell) becomes the host index there.
        command = " ".join(words)
        res = bed.run(
            command,
            procs_per_host=args.procs_per_host,
            timeout=args.timeout,
            log_dir=args.log_dir,
            echo=args.echo,
        )
        for r in res.results:
            if r.returncode != 0:
                print(
                    f"netbed: host {r.host} proc {r.proc} exited {r.returncode}; log {r.log}", file=sys.stderr
                )
        if res.timed_out:
            print(f"netbed: timed out after {args.timeout:.0f} s; every process was killed", file=sys.stderr)
        print(
            f"netbed: {'ok' if res.ok else 'FAILED'} in {res.seconds:.1f} s; logs in {res.log_dir}",
            file=sys.stderr,
        )
        return res.returncode
    finally:
        bed.down()


if __name__ == "__main__":
    sys.exit(main())
