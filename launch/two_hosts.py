"""Two hosts on one machine, to run `deepspeed --hostfile` for real: two Linux network namespaces
joined by a veth pair, each with its own hostname (node1, node2), address (10.77.0.1, .2 on eth0)
and sshd with a throwaway key. The DeepSpeed launcher runs inside node1 and reaches both hosts
over ssh through pdsh, exactly as on a cluster.

    sudo .venv/bin/python -m launch.two_hosts --data DATA --out RUN [train.py flags...]
    sudo .venv/bin/python -m launch.two_hosts --shell          # a shell on node1, to poke around

Needs root, `ip` (iproute2), `unshare`, and Debian's `pdsh`, `openssh-server` and `openssh-client`.
Every address lives only inside the namespaces made here. Everything made here (namespaces, the
veth pair, /etc/netns/<ns>/, /run/netns if it was not there, sshd processes, the keys) is
removed on exit, also on failure or Ctrl-C. The hosts share this machine's file system, so the repo, its .venv, the data and --out
are at the same path on both, as a shared file system gives a real cluster.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.77.0"
TOOLS = {"ip": "iproute2", "unshare": "util-linux", "pdsh": "pdsh", "ssh": "openssh-client"}
SSHD = "/usr/sbin/sshd"
RUN_NETNS = Path("/run/netns")  # `ip netns add` makes it (a mount point) when missing


def _drop_run_netns() -> None:
    """Undo what the first `ip netns add` did to /run/netns, if no namespace is left in it."""
    try:
        if not any(RUN_NETNS.iterdir()):
            subprocess.run(["umount", str(RUN_NETNS)], capture_output=True)
            RUN_NETNS.rmdir()
    except OSError:
        pass


def unavailable() -> str | None:
    """Why two hosts cannot be made here (None if they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    missing = [pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
    if not os.access(SSHD, os.X_OK):
        missing.append("openssh-server")
    if missing:
        return "missing packages: " + " ".join(missing) + " (apt-get install -y ...)"
    name = f"zsprobe{os.getpid()}"
    had_run_netns = RUN_NETNS.exists()
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode == 0:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    if not had_run_netns:
        _drop_run_netns()
    if p.returncode != 0:
        return f"cannot make network namespaces here: {p.stderr.strip()}"
    return None


def reap_stale() -> None:
    """Remove the namespaces (and what ran in them, and their /etc/netns entries) of an earlier
    TwoHosts whose process is gone without cleaning up (killed with SIGKILL, say)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for ns in re.findall(r"^(zs(\d+)n[12])\b", listed, flags=re.M):
        name, pid = ns[0], int(ns[1])
        if pid == os.getpid() or Path(f"/proc/{pid}").exists():
            continue  # its owner still runs
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for p in pids.stdout.split():
            try:
                os.kill(int(p), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


class TwoHosts:
    """Context manager: `with TwoHosts() as hosts: hosts.run([...])` runs a command on node1.

    `hosts.hostfile` is a DeepSpeed hostfile with one slot per host; the hosts resolve each
    other as node1/node2, and `GLOO_SOCKET_IFNAME=eth0` names the link between them."""

    names = ("node1", "node2")

    def __init__(self, workdir: str | os.PathLike | None = None):
        # namespace (and veth) names, <= 15 characters, carrying our pid: see reap_stale()
        self.ns = [f"zs{os.getpid()}n{i + 1}" for i in range(2)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(2)]
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="zs-two-hosts-"))
        self._sshd: list[subprocess.Popen] = []
        self._made_ns: list[str] = []
        self._made_dirs: list[Path] = []  # ours, with our files in them
        self._mount_points: list[Path] = []  # empty directories made for sshd or a bind mount
        self._made_run_netns = False
        self.hostfile = self.workdir / "hostfile"
        self.dotssh = self.workdir / "dotssh"

    # -- set up -------------------------------------------------------------------------------
    def __enter__(self) -> TwoHosts:
        self.workdir.mkdir(parents=True, exist_ok=True)
        reap_stale()
        try:
            self._network()
            self._keys()
            for i in range(2):
                self._start_sshd(i)
            self._wait_for_ssh()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _sh(self, *cmd: str) -> None:
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip() or p.stdout.strip()}")

    def _network(self) -> None:
        n1, n2 = self.ns
        self._made_run_netns = not RUN_NETNS.exists()
        for ns in self.ns:
            self._sh("ip", "netns", "add", ns)
            self._made_ns.append(ns)
        # One veth pair; each end moves into its namespace and is renamed eth0 there, so the same
        # GLOO_SOCKET_IFNAME works on both hosts.
        self._sh("ip", "link", "add", n1, "type", "veth", "peer", "name", n2)
        for ns, addr in zip(self.ns, self.addrs):
            self._sh("ip", "link", "set", ns, "netns", ns)
            self._sh("ip", "-n", ns, "link", "set", ns, "name", "eth0")
            self._sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            self._sh("ip", "-n", ns, "link", "set", "lo", "up")
            self._sh("ip", "-n", ns, "link", "set", "eth0", "up")
            # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts.
            d = Path("/etc/netns") / ns
            if not d.parent.exists():
                d.parent.mkdir(parents=True)
                self._mount_points.append(d.parent)
            d.mkdir(exist_ok=True)
            self._made_dirs.append(d)
            hosts = "127.0.0.1 localhost\n" + "".join(
                f"{a} {n}\n" for a, n in zip(self.addrs, self.names)
            )
            (d / "hosts").write_text(hosts)
        self.hostfile.write_text("".join(f"{n} slots=1\n" for n in self.names))

    def _keys(self) -> None:
        self.dotssh.mkdir(mode=0o700, exist_ok=True)
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
        self._sh(*keygen, "-f", str(self.workdir / "hostkey"))
        self._sh(*keygen, "-f", str(self.dotssh / "id_ed25519"))
        shutil.copy(self.dotssh / "id_ed25519.pub", self.workdir / "authorized_keys")
        # The client side, seen as ~/.ssh only by commands run through `run` (a private bind
        # mount): this key for node1/node2, no host-key prompts, nothing remembered.
        (self.dotssh / "config").write_text(
            "Host node1 node2\n"
            f"  IdentityFile {self.dotssh / 'id_ed25519'}\n"
            "  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n"
        )
        os.chmod(self.dotssh / "config", 0o600)
        run_sshd = Path("/run/sshd")  # sshd's privilege-separation directory
        if not run_sshd.exists():
            run_sshd.mkdir(mode=0o755, parents=True)
            self._mount_points.append(run_sshd)

    def _start_sshd(self, i: int) -> None:
        conf = self.workdir / f"sshd_{self.names[i]}.conf"
        conf.write_text(
            f"ListenAddress {self.addrs[i]}\n"
            "Port 22\n"
            f"HostKey {self.workdir / 'hostkey'}\n"
            f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "StrictModes no\n"
            "UsePAM no\n"
            "PrintMotd no\n"
            f"PidFile {self.workdir / f'sshd_{self.names[i]}.pid'}\n"
        )
        log = open(self.workdir / f"sshd_{self.names[i]}.log", "w")  # noqa: SIM115
        # ip netns exec, unshare and `exec` all replace the process: the Popen pid is sshd's.
        self._sshd.append(
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.ns[i],
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    f'hostname {self.names[i]} && exec {SSHD} -D -e -f "$0"',
                    str(conf),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def _wait_for_ssh(self, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        for name in self.names:
            while True:
                p = self.run(
                    ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=2", name, "hostname"],
                    timeout=15,
                    check=False,
                )
                if p.returncode == 0 and p.stdout.strip() == name:
                    break
                if any(s.poll() is not None for s in self._sshd) or time.time() > deadline:
                    logs = "".join(
                        (self.workdir / f"sshd_{n}.log").read_text()[-1000:] for n in self.names
                    )
                    raise RuntimeError(
                        f"sshd on {name} did not answer: {p.stderr.strip()[-500:]}\n{logs}"
                    )
                time.sleep(0.3)

    # -- use ----------------------------------------------------------------------------------
    def command(self, cmd: list[str], host: int = 0) -> list[str]:
        """`cmd` wrapped to run on host `host` (0: node1), with the throwaway key as ~/.ssh."""
        home_ssh = Path.home() / ".ssh"
        if not home_ssh.exists():  # the bind mount needs a mount point; removed again on close
            home_ssh.mkdir(mode=0o700)
            self._mount_points.append(home_ssh)
        # `ip netns exec` gives the command its own mount namespace, so this bind mount of the
        # throwaway ~/.ssh is seen by it and its children only, never by the rest of the machine.
        script = f'hostname {self.names[host]} && mount --bind "$0" "$1" && shift && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.ns[host],
            "unshare",
            "--uts",
            "sh",
            "-c",
            script,
            str(self.dotssh),
            str(home_ssh),
            *cmd,
        ]

    def run(
        self,
        cmd: list[str],
        host: int = 0,
        env: dict | None = None,
        timeout: float = 600,
        check: bool = True,
        cwd: str | os.PathLike = REPO,
    ) -> subprocess.CompletedProcess:
        """Run `cmd` on node1 (or node2) and wait; a timeout kills it and everything it started
        in these namespaces."""
        full = self.command(cmd, host)
        proc = subprocess.Popen(
            full,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_namespace_processes(keep=self.sshd_pids())
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            raise TimeoutError(
                f"{' '.join(cmd)} timed out after {timeout}s:\n{out[-3000:]}\n{err[-3000:]}"
            ) from None
        p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        if check and p.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({p.returncode}):\n{out[-4000:]}\n{err[-6000:]}"
            )
        return p

    # -- tear down ----------------------------------------------------------------------------
    def sshd_pids(self) -> set[int]:
        """The two sshd processes, while they run."""
        return {s.pid for s in self._sshd if s.poll() is None}

    def host_pids(self, host: int) -> set[int]:
        """Every process on host `host` (0: node1): its sshd, ssh sessions, launchers, ranks."""
        p = subprocess.run(["ip", "netns", "pids", self.ns[host]], capture_output=True, text=True)
        return {int(x) for x in p.stdout.split()}

    def namespace_pids(self) -> set[int]:
        """Every process inside the two namespaces (sshd, ssh sessions, ranks)."""
        pids: set[int] = set()
        for ns in self._made_ns:
            p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            pids |= {int(x) for x in p.stdout.split()}
        return pids

    def _kill_namespace_processes(self, keep: set[int] = frozenset()) -> None:
        """SIGKILL every process inside our namespaces (ranks, ssh sessions), by pid."""
        for _ in range(5):
            pids = self.namespace_pids() - set(keep) - {os.getpid()}
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def close(self) -> None:
        """Remove everything this object made; safe to call twice, and after a partial set-up."""
        for s in self._sshd:
            if s.poll() is None:
                s.kill()
            s.wait()
        self._sshd.clear()
        self._kill_namespace_processes()
        for ns in self._made_ns:  # deleting a namespace deletes its end of the veth, and so both
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self._made_ns:  # a veth pair that never made it into the namespaces
            subprocess.run(["ip", "link", "del", self.ns[0]], capture_output=True)
        self._made_ns.clear()
        if self._made_run_netns:
            _drop_run_netns()
        for d in self._made_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._made_dirs.clear()
        for d in reversed(self._mount_points):
            try:
                d.rmdir()  # only if still empty: never take anything that is not ours
            except OSError:
                pass
        self._mount_points.clear()
        for key in ("hostkey", "dotssh", "authorized_keys"):  # the keys go in any case
            p = self.workdir / key
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            Path(str(p) + ".pub").unlink(missing_ok=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Make two hosts on this machine and run a 2-rank `deepspeed --hostfile` "
        "training job across them (launch/hostfile.sh), one rank per host.",
        epilog="Other arguments go to training/train.py (e.g. --data DIR --out RUN --model tiny).",
        allow_abbrev=False,  # so no train.py flag is taken for an abbreviation of ours
    )
    p.add_argument("--shell", action="store_true", help="open a shell on node1 instead")
    p.add_argument("--timeout", type=float, default=1800)
    args, train_args = p.parse_known_args(argv)
    why = unavailable()
    if why:
        print(f"error: cannot make two hosts here: {why}", file=sys.stderr)
        return 2
    with TwoHosts() as hosts:
        print(f"two hosts up: node1={hosts.addrs[0]} node2={hosts.addrs[1]} ({hosts.hostfile})")
        if args.shell:
            return subprocess.call(hosts.command([os.environ.get("SHELL", "/bin/bash")]), cwd=REPO)
        env_file = hosts.workdir / "deepspeed_env"
        cmd = ["bash", "launch/hostfile.sh", str(hosts.hostfile), "node1", *train_args]
        env = {"GLOO_SOCKET_IFNAME": "eth0", "DS_ENV_FILE": str(env_file)}
        # Its own session: Ctrl-C must not reach DeepSpeed's runner, whose SIGINT handler runs
        # `pkill -f train.py` on every host, and these hosts share one machine's processes.
        # Leaving the `with` kills what runs in the namespaces instead, by pid.
        proc = subprocess.Popen(
            hosts.command(cmd), cwd=REPO, env={**os.environ, **env}, start_new_session=True
        )
        try:
            return proc.wait(timeout=args.timeout)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            print("stopping: killing the job's processes on both hosts", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
