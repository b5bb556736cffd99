"""Who holds a lease: a worker process's owner string, and reading one back.

An owner reads ``host:pid@namespace``. The pid alone means nothing outside its PID namespace:
worker containers that share a host name (Docker's host networking) each have their own, and
with the threads pool both main processes are often pid 1. The namespace is the inode of
``/proc/self/ns/pid`` with the kernel's boot id (host names can repeat across machines; the
root namespace's inode is the same on every Linux host). Where it cannot be read (not Linux),
the owner has no namespace, and no pid in it is ever checked from another process.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

_PID_NAMESPACE = Path("/proc/self/ns/pid")
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    namespace: str | None  # None: an owner in the old ``host:pid`` form, or from a non-Linux host


def pid_namespace() -> str | None:
    """This process's PID namespace, ``pidns<inode>.<boot id>``, or None where there is none."""
    try:
        inode = os.stat(_PID_NAMESPACE).st_ino
        boot_id = _BOOT_ID.read_text().strip()
    except OSError:
        return None
    return f"pidns{inode}.{boot_id}"


def this_process() -> Owner:
    return Owner(host=socket.gethostname(), pid=os.getpid(), namespace=pid_namespace())


def format_owner(owner: Owner) -> str:
    base = f"{owner.host}:{owner.pid}"
    return base if owner.namespace is None else f"{base}@{owner.namespace}"


def parse_owner(text: str | None) -> Owner | None:
    """A worker process's owner read back, or None for any other holder (the CLI, a deleter)."""
    base, _, namespace = (text or "").partition("@")
    host, _, pid = base.rpartition(":")
    if not host or not pid.isdigit():
        return None
    return Owner(host=host, pid=int(pid), namespace=namespace or None)
