"""The system-call filter every command under bubblewrap runs with: the calls container runtimes refuse get EPERM.

Why: namespaces hide the host, but every command still reaches the whole kernel, and most container escapes and
privilege escalations go through a few interfaces an unprivileged program never needs: io_uring, eBPF, perf events,
userfaultfd (a tool to win kernel races), keyrings (kernel state shared beyond the sandbox), ptrace and other
processes' memory (including PID 1, which the filter does not cover), mounts and new namespaces, modules, the clock,
swap and reboot. This module builds, with libseccomp (through ``pyseccomp``), the BPF program that refuses them, as
Docker's and containerd's default profiles do: EPERM rather than death, so programs that try them degrade as they
would in a container. ``clone3`` gets ENOSYS (its flags sit in memory a filter cannot read), on which the C library
falls back to ``clone``, whose namespace flags the filter does read. The same rules cover the 32-bit ABIs (``int 0x80``,
x32), so that no second entry to the kernel skips them.

The program is loaded by the sandbox's command server (or the same code run before a command) once its own setup,
which needs keyrings, mounts and a user namespace, is done: see ``trajlab/sandbox/command_server.py``.
"""

from __future__ import annotations

import errno
import functools
import platform
import tempfile

#: Refused with EPERM, by name (a name a machine's kernel lacks is skipped there).
BLOCKED = (
    # Kernel interfaces behind many exploits, reachable without privileges
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open", "userfaultfd",
    # Keyrings: kernel state kept per uid, beyond the sandbox's processes
    "keyctl", "add_key", "request_key",
    # Other processes' memory and descriptors
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp", "pidfd_getfd",
    # Mounts, the root and namespaces
    "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    # Files by handle, past the mount namespace's view
    "open_by_handle_at", "name_to_handle_at", "fanotify_init",
    # The machine: clock, swap, reboot, modules, accounting, quotas, kernel log, I/O ports, old interfaces
    "settimeofday", "stime", "clock_settime", "clock_adjtime", "adjtimex", "swapon", "swapoff", "reboot",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module",
    "get_kernel_syms", "query_module", "acct", "quotactl", "quotactl_fd", "nfsservctl", "lookup_dcookie", "syslog",
    "vhangup", "iopl", "ioperm", "uselib", "ustat", "sysfs", "_sysctl", "vm86", "vm86old",
)
#: The flags of ``clone`` that make a namespace: refused with EPERM, like ``unshare``.
NAMESPACE_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
#: The bits of the personalities ``personality`` may set: Linux (0), 32-bit Linux (0x8), UNAME26 (0x20000), as Docker
#: allows; and 0xffffffff, which only asks. Any other bit would, say, switch off address space randomisation.
PERSONALITY_BITS = 0x20008
#: The ABIs a process of each machine can enter the kernel through besides its own.
_COMPAT_ARCHES = {"x86_64": ("X86", "X32"), "aarch64": ("ARM",)}
#: Which argument of ``clone`` holds its flags: the first, but on s390x, where the stack comes first.
_CLONE_FLAGS_ARG = {"s390x": 1}.get(platform.machine(), 0)
_UNKNOWN = -1  # libseccomp's number for a name it does not know (one a machine lacks gets another negative number)


@functools.cache
def filter_program() -> bytes | None:
    """The filter as a BPF program (``struct sock_filter`` array), or None where it cannot be built: no ``pyseccomp``
    or no libseccomp (``apt-get install libseccomp2``) here."""
    try:
        import pyseccomp as seccomp  # loads libseccomp itself: a RuntimeError when it is missing
    except (ImportError, RuntimeError, OSError):
        return None
    refuse = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for arch in _COMPAT_ARCHES.get(platform.machine(), ()):
        rules.add_arch(getattr(seccomp.Arch, arch))
    for name in BLOCKED:
        if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) != _UNKNOWN:  # an older libseccomp may lack a name
            rules.add_rule(refuse, name)
    for flag in NAMESPACE_FLAGS:
        rules.add_rule(refuse, "clone", seccomp.Arg(_CLONE_FLAGS_ARG, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    # libseccomp compares an argument once per rule: one rule per bit. Bit 31 clear: a bit no allowed personality
    # sets; bit 31 set: any other bit clear (0xffffffff alone has them all).
    top = 1 << 31
    for bit in (1 << n for n in range(31)):
        if not bit & PERSONALITY_BITS:
            rules.add_rule(refuse, "personality", seccomp.Arg(0, seccomp.MASKED_EQ, bit | top, bit))
        rules.add_rule(refuse, "personality", seccomp.Arg(0, seccomp.MASKED_EQ, bit | top, top))
    with tempfile.TemporaryFile() as program:
        rules.export_bpf(program)
        program.seek(0)
        return program.read()
