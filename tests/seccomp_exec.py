"""`python seccomp_exec.py SYSCALL,SYSCALL,... -- COMMAND...`: run COMMAND under a system-call allow-list.

What systemd's SystemCallFilter= does, through the same libseccomp, only stricter:
a call outside the list kills the process (SIGSYS) instead of failing with
EPERM, so no refused call goes unnoticed. The filter holds across exec.
"""

from __future__ import annotations

import ctypes
import os
import sys

SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_ALLOW = 0x7FFF0000


def load_filter(names: list[str]) -> None:
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_KILL_PROCESS)  # native architecture only, as SystemCallArchitectures=native
    if not ctx:
        raise OSError("seccomp_init failed")
    for name in names:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        # A name this architecture lacks (e.g. arm_fadvise64_64) resolves negative: nothing to allow.
        if nr >= 0 and lib.seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 0) != 0:
            raise OSError(f"seccomp_rule_add({name}) failed")
    if lib.seccomp_load(ctx) != 0:  # sets no_new_privs first, as NoNewPrivileges=yes
        raise OSError("seccomp_load failed")


if __name__ == "__main__":
    separator = sys.argv.index("--")
    load_filter(sys.argv[1].split(","))
    command = sys.argv[separator + 1:]
    os.execv(command[0], command)
