"""A real DNS server for the discovery tests: Debian's dnsmasq on loopback, on a high port, serving the
records a test writes (A records from a hosts file re-read on SIGHUP, SRV records from its config file)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

DOMAIN = "kvgate.test"


def dnsmasq_binary() -> str:
    found = shutil.which("dnsmasq") or ("/usr/sbin/dnsmasq" if Path("/usr/sbin/dnsmasq").exists() else None)
    if found is None:
        if os.environ.get("CI"):
            raise RuntimeError("dnsmasq is missing: .ci/run installs it (apt-get install dnsmasq-base)")
        pytest.skip("dnsmasq is not installed (apt-get install dnsmasq-base; .ci/run installs it)")
    return found


def _free_udp_port() -> int:
    """A port free for UDP and for TCP too (dnsmasq listens on both, and the other tests' servers take
    TCP ports all the time)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
            try:
                t.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


class Dnsmasq:
    def __init__(self, tmp: Path) -> None:
        self.binary = dnsmasq_binary()
        self.tmp = tmp
        self.port = _free_udp_port()
        self.hosts = tmp / "hosts"
        self.conf = tmp / "dnsmasq.conf"
        self.log = tmp / "dnsmasq.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._records: tuple[dict[str, list[str]], Sequence[tuple[str, str, int]]] = ({}, ())

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def write(self, a: dict[str, list[str]], srv: Sequence[tuple[str, str, int]] = ()) -> None:
        """``a``: name -> addresses; ``srv``: (service name, target, port)."""
        self._records = (a, srv)
        self.hosts.write_text("".join(f"{ip} {name}\n" for name, ips in a.items() for ip in ips))
        self.conf.write_text("\n".join([
            f"port={self.port}", "listen-address=127.0.0.1", "bind-interfaces", "no-resolv", "no-hosts",
            f"addn-hosts={self.hosts}", f"local=/{DOMAIN}/", "user=root", "pid-file=",
            *(f"srv-host={name},{target},{port}" for name, target, port in srv)]) + "\n")

    def start(self, attempts: int = 5) -> None:
        """Started on a free port; a port taken between choosing it and binding it is chosen again."""
        for attempt in range(attempts):
            try:
                return self._start()
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                self.port = _free_udp_port()
                self.write(*self._records)

    def _start(self) -> None:
        self.log.unlink(missing_ok=True)
        self.proc = subprocess.Popen([self.binary, "--keep-in-foreground", f"--conf-file={self.conf}",
                                      f"--log-facility={self.log}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited: {self.log.read_text() if self.log.exists() else ''}")
            if self.log.exists() and "started" in self.log.read_text():
                return
            time.sleep(0.05)
        raise TimeoutError("dnsmasq did not start")

    def reload_hosts(self) -> None:
        """dnsmasq re-reads its hosts files on SIGHUP (its SRV records need a restart)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)
        time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
