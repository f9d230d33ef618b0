"""The attack suite's hands: run hostile commands, each in a fresh sandbox (new, or given back to a pool by the attack
before and wiped), and report what each did as JSON.

Why apart from the test module: the same attacks run in the test process (as root) and in a child process as an
unprivileged user (``python -m tests.sandbox.attack_driver``, a request on stdin, the report on stdout), whose
sandboxes then get only what an unprivileged host gives.

Each command may name ``{other}`` (the directory of another episode's sandbox, which holds ``flag.txt``) and
``{host_pid}`` (this process, the sandboxes' host).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import sys
from typing import Any

from tests.sandbox.helpers import live_processes
from trajlab.sandbox import (
    MissingProtection,
    Sandbox,
    SandboxLimits,
    probe_protections,
    protections,
    require_strong_isolation,
)
from trajlab.sandbox.pool import SandboxPool

OTHER_FLAG = "flag{0ther0episode0secret00}"


def run_attacks(commands: dict[str, str], limits: SandboxLimits, marker: str, *,
                recycled: bool = False, per_command: bool = False) -> dict[str, Any]:
    """Run every command in a fresh sandbox beside another episode's; what each did, and what was left after.

    ``marker`` is in the command line of every process the attacks start: any still alive when its call returned
    is reported under ``running_after_call`` (the host's own such processes, running before, are not).
    ``recycled``: the fresh sandboxes come from one :class:`SandboxPool` keeping one, so each attack runs in the
    sandbox the attack before it was given back; files found in it after a wipe are reported under ``not_wiped``.
    ``per_command``: each sandbox starts one bwrap per command (no command server, no pool).
    """
    hosts = live_processes(marker).keys()
    report: dict[str, Any] = {"results": {}, "paths": [], "running_after_call": {}, "not_wiped": {},
                              **strong_isolation_verdict()}
    with Sandbox(limits, reuse_namespaces=not per_command) as other, \
            SandboxPool(limits, keep=1 if recycled else 0) as pool:
        report["protections"] = dataclasses.asdict(other.protections())
        other.write_file("flag.txt", OTHER_FLAG)
        report["paths"].append(str(other.path))
        made = 0
        for name, command in commands.items():
            box = Sandbox(limits, reuse_namespaces=False) if per_command else pool.acquire()
            made += per_command
            try:
                report["paths"].append(str(box.path))
                filled = command.replace("{other}", str(other.path)).replace("{host_pid}", str(os.getpid()))
                report["results"][name] = dataclasses.asdict(box.run(filled))
                if running := [line for pid, line in live_processes(marker).items() if pid not in hosts]:
                    report["running_after_call"][name] = running
            finally:
                if per_command:
                    box.cleanup()
                else:
                    pool.release(box)
            if recycled and os.path.exists(box.path) and (found := os.listdir(box.path)):
                report["not_wiped"][name] = found
        after = other.run("cat flag.txt")
        report["other_intact"] = other.read_file("flag.txt").decode() == OTHER_FLAG and after.stdout == OTHER_FLAG
        report["sandboxes_made"] = pool.made + made
    report["paths_left"] = sorted({path for path in report["paths"] if os.path.exists(path)})
    return report


def strong_isolation_verdict() -> dict[str, str]:
    """What :func:`require_strong_isolation` says here: the refusal (``refused``), and the warning it logs when the
    user opts out of what is missing by name (``warned``); empty where nothing is missing."""
    try:
        require_strong_isolation("the attack suite", allow_weak=False)
    except MissingProtection as exc:
        refused = str(exc)
    else:
        return {"refused": "", "warned": ""}
    missing = [line.split(":")[0] for line in probe_protections().missing_for_strong_isolation()]
    logger, records = logging.getLogger(protections.__name__), io.StringIO()
    handler = logging.StreamHandler(records)
    logger.addHandler(handler)
    try:
        require_strong_isolation("the attack suite", allow_weak=missing)
    finally:
        logger.removeHandler(handler)
    return {"refused": refused, "warned": records.getvalue()}


def main() -> None:
    request = json.load(sys.stdin)
    report = run_attacks(request["commands"], SandboxLimits(**request["limits"]), request["marker"],
                         recycled=request["recycled"], per_command=request["per_command"])
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
