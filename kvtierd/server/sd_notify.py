"""A tiny sd_notify(3) client: readiness, status and watchdog pings for systemd.

The protocol is one datagram of newline-separated `KEY=value` lines sent to the
AF_UNIX socket named in $NOTIFY_SOCKET (a leading '@' means the abstract
namespace). Outside systemd the variable is unset and every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*assignments: str) -> bool:
    """Sends `KEY=value` lines (`READY=1`, `STATUS=...`) to systemd in one datagram; whether it was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)  # a full queue blocks the sender: never the event loop for long
            sock.sendto("\n".join(assignments).encode(), address)
        return True
    except OSError as e:  # systemd going away must not take the daemon with it
        log.warning("sd_notify to %s failed: %s", address.replace("\0", "@"), e)
        return False


def watchdog_period() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of systemd's WatchdogSec=), or None when nobody watches us.

    $WATCHDOG_PID, when set, names the process the watchdog is meant for: a child
    that inherited the variables must not ping on its parent's behalf."""
    usec, pid = os.environ.get("WATCHDOG_USEC", ""), os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6
