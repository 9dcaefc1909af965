#!/usr/bin/env python3
"""Run an MPI job over emulated, rate-limited links between network namespaces.

    python scripts/netem.py --rate 1gbit -np 3 -- python scripts/bench_exchange.py --n 1000000
    python scripts/netem.py --rate none  -np 3 -- python scripts/bench_exchange.py   # plain loopback

With a rate (any ``tc`` rate: ``100mbit``, ``1gbit``, ``10gbit`` ...) the script builds,
under a fresh unique name prefix ``hsn<hex>``::

    <prefix>sw      namespace holding the bridge br0 (one port p<i> per endpoint)
    <prefix>launch  namespace of mpirun itself        eth0 = first host of --subnet
    <prefix><r>     one namespace per rank r          eth0 = next hosts of --subnet
                    with ``tc qdisc replace dev eth0 root tbf rate R burst 256kb latency 50ms``

Every veth pair is created inside the switch namespace with its peer moved straight
into the endpoint namespace, so nothing is ever added to the host's own namespace and
the only addresses in use live inside namespaces this script created (the endpoints
have no route other than the test subnet, so no traffic can reach a real network).
``mpirun`` runs inside ``<prefix>launch`` with TCP-only transports restricted to the
test subnet, and starts each rank through a wrapper that does
``exec ip netns exec <prefix>$OMPI_COMM_WORLD_RANK "$@"``.

Everything created (namespaces, hence the bridge, veths and qdiscs; the wrapper's temp
dir) is removed in a ``finally`` block, also on Ctrl-C, SIGTERM, SIGHUP or an error.
Only names recorded as created by this run are ever deleted.

With ``--rate none`` no namespace is made (and no privilege is needed): mpirun runs
directly, by default with the TCP BTL over ``lo`` so that "loopback" timings use the
same transport as the emulated links (``--btl vader,self`` selects shared memory).

Exit status: the MPI job's status; 2 for a usage error; 3 when the privileges to
create namespaces are missing.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

EXIT_USAGE = 2
EXIT_NO_PRIVILEGE = 3

RATE_RE = re.compile(r"^\d+(\.\d+)?([kmgt]i?)?(bit|bps)$", re.IGNORECASE)
# Environment variable that tells the benchmark which link it runs on.
RATE_ENV = "HSP_NETEM_RATE"


class NetemError(RuntimeError):
    """A failure while building the emulated network."""


class PrivilegeError(NetemError):
    """The caller may not create network namespaces."""


class _Terminated(BaseException):
    """Raised from the SIGTERM/SIGHUP handler so that ``finally`` blocks run."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


# --------------------------------------------------------------------------- CLI
def _rate(text: str) -> str:
    t = text.strip().lower()
    if t in ("none", "loopback", "lo", "off"):
        return "none"
    if not RATE_RE.match(t):
        raise argparse.ArgumentTypeError(
            f"bad rate {text!r}: use a tc rate such as 100mbit, 1gbit, 10gbit, or 'none'")
    return t


def _subnet(text: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(text, strict=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad subnet {text!r}: {e}") from None
    if not (net.is_private or net.subnet_of(ipaddress.IPv4Network("198.18.0.0/15"))):
        raise argparse.ArgumentTypeError(
            f"subnet {text} is not a private/test range; use e.g. 198.18.0.0/24 or 10.x.y.0/24")
    return net


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="netem.py",
        description="Run `mpirun -np N CMD` over rate-limited links between throw-away "
                    "network namespaces (or plain loopback with --rate none).",
        epilog="example: python scripts/netem.py --rate 1gbit -np 3 -- "
               "python scripts/bench_exchange.py --n 1000000")
    p.add_argument("--rate", type=_rate, required=True,
                   help="egress rate of every rank's link (tc syntax: 1gbit, 10gbit, 500mbit), "
                        "or 'none' for plain loopback without namespaces")
    p.add_argument("-np", "--np", dest="np", type=_positive_int, required=True,
                   help="number of MPI ranks")
    p.add_argument("--subnet", type=_subnet, default=_subnet("198.18.0.0/24"),
                   help="private test subnet used only inside the namespaces "
                        "(default 198.18.0.0/24, the RFC 2544 benchmarking range)")
    p.add_argument("--burst", default="256kb", help="tbf burst (default 256kb)")
    p.add_argument("--latency", default="50ms", help="tbf latency (default 50ms)")
    p.add_argument("--btl", default="tcp,self",
                   help="Open MPI BTLs (default tcp,self; with a rate only tcp,self makes sense)")
    p.add_argument("--mpirun", default="mpirun", help="mpirun executable (default: mpirun)")
    p.add_argument("--mpirun-args", default="",
                   help="extra mpirun arguments, one shell-quoted string")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands that would run, change nothing")
    p.add_argument("-v", "--verbose", action="store_true", help="echo every setup command")
    return p


def parse_args(argv=None):
    """Parse ``[options] -- command ...``. Returns (namespace, command list)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        opts, cmd = argv[:cut], argv[cut + 1:]
    else:
        opts, cmd = argv, []
    parser = build_parser()
    args = parser.parse_args(opts)
    if not cmd:
        parser.error("missing the command to run: add `-- python your_script.py ...`")
    if args.rate != "none" and args.np + 1 > args.subnet.num_addresses - 2:
        parser.error(f"subnet {args.subnet} has too few addresses for {args.np} ranks + launcher")
    return args, cmd


# ---------------------------------------------------------------- privileges
def _tool(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None)


def check_privileges(euid: int | None = None) -> None:
    """Raise PrivilegeError with a readable message unless we can build namespaces."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise PrivilegeError(
            "netem.py needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network "
            "namespaces, veth pairs and tc qdiscs; rerun it as root (e.g. with sudo), "
            "or use --rate none for plain loopback without emulation.")
    for tool in ("ip", "tc"):
        if _tool(tool) is None:
            raise PrivilegeError(f"`{tool}` (iproute2) not found; install iproute2.")


# ------------------------------------------------------------------- topology
class Topology:
    """The namespaces, bridge and links of one run; ``teardown`` undoes ``setup``."""

    def __init__(self, np_: int, rate: str, subnet: ipaddress.IPv4Network, burst="256kb",
                 latency="50ms", prefix: str | None = None, dry_run=False, verbose=False):
        self.np = np_
        self.rate = rate
        self.subnet = subnet
        self.burst = burst
        self.latency = latency
        self.dry_run = dry_run
        self.verbose = verbose or dry_run
        self.ip = _tool("ip") or "ip"
        self.tc = _tool("tc") or "tc"
        self.prefix = prefix or self._fresh_prefix()
        self.switch = f"{self.prefix}sw"
        self.launcher = f"{self.prefix}launch"
        self.ranks = [f"{self.prefix}{r}" for r in range(np_)]
        hosts = subnet.hosts()
        self.addr = {self.launcher: next(hosts)}
        for ns in self.ranks:
            self.addr[ns] = next(hosts)
        self.created: list[str] = []        # namespaces we made, in order
        self.tmpdir: str | None = None
        self.wrapper: str | None = None

    # names ------------------------------------------------------------------
    def _existing(self) -> set[str]:
        if self.dry_run:
            return set()
        out = subprocess.run([self.ip, "netns", "list"], capture_output=True, text=True)
        return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}

    def _fresh_prefix(self) -> str:
        existing = set() if self.dry_run else self._existing()
        for _ in range(100):
            prefix = "hsn" + secrets.token_hex(3)
            if not any(name.startswith(prefix) for name in existing):
                return prefix
        raise NetemError("could not find an unused namespace prefix")

    # commands ---------------------------------------------------------------
    def _run(self, *cmd: str) -> None:
        if self.verbose:
            print("+ " + shlex.join(cmd), file=sys.stderr)
        if self.dry_run:
            return
        res = subprocess.run(list(cmd), capture_output=True, text=True)
        if res.returncode != 0:
            raise NetemError(f"`{shlex.join(cmd)}` failed ({res.returncode}): "
                             f"{res.stderr.strip()}")

    def _add_ns(self, name: str) -> None:
        if name in self._existing():   # never adopt (and later delete) someone else's
            raise NetemError(f"namespace {name} already exists; refusing to touch it")
        try:
            self._run(self.ip, "netns", "add", name)
        except NetemError as e:
            if not self.created:   # the very first one: almost surely a privilege problem
                raise PrivilegeError(
                    f"cannot create network namespaces (`ip netns add` failed: {e}); "
                    "netem.py needs root with CAP_SYS_ADMIN/CAP_NET_ADMIN (not available in "
                    "many containers). Use --rate none for plain loopback.") from None
            raise
        self.created.append(name)

    # build ------------------------------------------------------------------
    def setup(self) -> None:
        plen = self.subnet.prefixlen
        self._add_ns(self.switch)
        self._run(self.ip, "-n", self.switch, "link", "set", "lo", "up")
        self._run(self.ip, "-n", self.switch, "link", "add", "br0", "type", "bridge",
                  "stp_state", "0", "forward_delay", "0")
        self._run(self.ip, "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate([self.launcher] + self.ranks):
            self._add_ns(ns)
            port = f"p{i}"
            # Both ends are born in the switch namespace; the peer moves at once to `ns`.
            self._run(self.ip, "-n", self.switch, "link", "add", port, "type", "veth",
                      "peer", "name", "eth0", "netns", ns)
            self._run(self.ip, "-n", self.switch, "link", "set", port, "master", "br0")
            self._run(self.ip, "-n", self.switch, "link", "set", port, "up")
            self._run(self.ip, "-n", ns, "link", "set", "lo", "up")
            self._run(self.ip, "-n", ns, "addr", "add", f"{self.addr[ns]}/{plen}", "dev", "eth0")
            self._run(self.ip, "-n", ns, "link", "set", "eth0", "up")
        for ns in self.ranks:
            self._run(self.ip, "netns", "exec", ns, self.tc, "qdisc", "replace", "dev", "eth0",
                      "root", "tbf", "rate", self.rate, "burst", self.burst,
                      "latency", self.latency)
        self.tmpdir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
        self.wrapper = os.path.join(self.tmpdir, "rank_wrapper.sh")
        with open(self.wrapper, "w") as f:
            f.write("#!/bin/sh\n"
                    "# generated by scripts/netem.py: run this rank inside its namespace\n"
                    f'exec {shlex.quote(self.ip)} netns exec {self.prefix}"$OMPI_COMM_WORLD_RANK" "$@"\n')
        os.chmod(self.wrapper, 0o755)
        if not self.dry_run:
            self._wait_links()

    def _wait_links(self, timeout=10.0) -> None:
        """Wait until the launcher reaches every rank over the bridge."""
        if shutil.which("ping") is None:
            return  # nothing to probe with; links of a fresh bridge are up at once
        deadline = time.monotonic() + timeout
        for ns in self.ranks:
            while True:
                res = subprocess.run([self.ip, "netns", "exec", self.launcher, "ping", "-c", "1",
                                      "-W", "1", str(self.addr[ns])], capture_output=True)
                if res.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise NetemError(f"rank namespace {ns} ({self.addr[ns]}) unreachable")
                time.sleep(0.2)

    def teardown(self) -> list[str]:
        """Delete what we created; returns the names that could not be removed."""
        failed = []
        for name in reversed(self.created):
            try:
                self._run(self.ip, "netns", "del", name)
            except NetemError as e:
                print(f"netem.py: warning: {e}", file=sys.stderr)
                failed.append(name)
        self.created = []
        if self.tmpdir and os.path.isdir(self.tmpdir):
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.tmpdir = None
        return failed


# ------------------------------------------------------------------ mpirun
def mpirun_command(args, cmd, topo: Topology | None):
    """The mpirun argv and the extra environment for it."""
    argv = [args.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(args.np),
            "--mca", "btl", args.btl]
    env = {RATE_ENV: "loopback" if args.rate == "none" else args.rate}
    if topo is None:
        if "tcp" in args.btl.split(","):
            argv += ["--mca", "btl_tcp_if_include", "lo"]
    else:
        subnet = str(args.subnet)
        argv += ["--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet]
        env.update(PMIX_MCA_ptl_tcp_remote_connections="1", PMIX_MCA_ptl_tcp_if_include=subnet)
    argv += shlex.split(args.mpirun_args)
    argv += ([topo.wrapper] if topo is not None else []) + list(cmd)
    if topo is not None:
        argv = [topo.ip, "netns", "exec", topo.launcher] + argv
    return argv, env


def _run_job(argv, env) -> int:
    """Run mpirun in its own session; forward Ctrl-C/SIGTERM; make sure it is gone."""
    proc = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        # Ctrl-C / SIGTERM / error: ask mpirun to stop its ranks, then insist.
        for sig, grace in ((signal.SIGINT, 5), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)     # the group is mpirun's own (new session)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        raise


def main(argv=None) -> int:
    args, cmd = parse_args(argv)
    if args.rate == "none":
        margv, env = mpirun_command(args, cmd, None)
        print(f"netem.py: loopback, no emulation: {shlex.join(margv)}", file=sys.stderr)
        if args.dry_run:
            return 0
        return _run_job(margv, env)

    if not args.dry_run:
        try:
            check_privileges()
        except PrivilegeError as e:
            print(f"netem.py: refusing to run: {e}", file=sys.stderr)
            return EXIT_NO_PRIVILEGE

    def _on_signal(signum, _frame):
        raise _Terminated(signum)

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    topo = Topology(args.np, args.rate, args.subnet, args.burst, args.latency,
                    dry_run=args.dry_run, verbose=args.verbose)
    rc = 1
    try:
        try:
            topo.setup()
        except PrivilegeError as e:
            print(f"netem.py: refusing to run: {e}", file=sys.stderr)
            return EXIT_NO_PRIVILEGE
        margv, env = mpirun_command(args, cmd, topo)
        print(f"netem.py: {args.np} ranks, {args.rate} per link (tbf burst {args.burst} "
              f"latency {args.latency}), namespaces {topo.prefix}*, subnet {args.subnet}",
              file=sys.stderr)
        if args.verbose or args.dry_run:
            print("+ " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(margv),
                  file=sys.stderr)
        if args.dry_run:
            return 0
        rc = _run_job(margv, env)
        return rc
    except NetemError as e:
        print(f"netem.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("netem.py: interrupted, cleaning up", file=sys.stderr)
        return 130
    except _Terminated as t:
        print(f"netem.py: got signal {t.signum}, cleaning up", file=sys.stderr)
        return 128 + t.signum
    finally:
        # Block further SIGTERM/SIGHUP/SIGINT while removing what we created.
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        left = topo.teardown()
        if left:
            print("netem.py: could not remove: " + " ".join(left), file=sys.stderr)
        for s, h in old.items():
            signal.signal(s, h)
        signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
