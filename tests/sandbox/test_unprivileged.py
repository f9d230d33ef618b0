"""Without root: the command server mounts the sandbox's working directory and tmp directories as capped tmpfs in its
own namespace, and the host reaches the files through ``/proc/<server>/root``. Run from a child of the unprivileged
user nobody (the tests run as root)."""

from __future__ import annotations

import json

from tests.sandbox.helpers import needs_bwrap, run_as_nobody

pytestmark = needs_bwrap

# What an unprivileged host sees of one sandbox, as JSON on stdout.
SCENARIO = """
import dataclasses, json, os, signal
from tests.sandbox.helpers import host_paths_seen, server_of
from trajlab.sandbox import Sandbox, SandboxError, SandboxLimits
report = {}
limits = SandboxLimits(disk_bytes=1 << 20, inodes=64, file_size_bytes=4 << 20, wall_timeout_s=1.0)
with Sandbox(limits) as box:
    report["protections"] = dataclasses.asdict(box.protections())
    box.write_file("task/input.txt", "from the host")
    report["read_inside"] = box.run("cat task/input.txt; echo from the command > out.txt").stdout
    report["read_by_host"] = box.read_file("out.txt").decode()
    report["host_directory"] = os.listdir(box.path)
    report["host_paths_seen"] = host_paths_seen(box)
    box.reset()
    report["host_paths_seen_after_reset"] = host_paths_seen(box)
    box.write_file("out.txt", "from the command\\n")
    report["fill"] = box.run("head -c 2000000 /dev/zero > big; stat -c %s big").stderr
    report["files"] = box.run("rm big; i=0; while : > f$i; do i=$((i+1)); done").stderr
    box.run("rm -f f*")
    report["timed_out"] = box.run("sleep 5").timed_out
    report["after_timeout"] = box.run("cat out.txt").stdout
    os.kill(server_of(box), signal.SIGKILL)
    try:
        box.run("true")
        box.run("true")
    except SandboxError as exc:
        report["server_lost"] = str(exc)
print(json.dumps(report))
"""


def test_the_working_directory_is_a_capped_tmpfs_the_host_reaches_and_a_timeout_keeps() -> None:
    done = run_as_nobody(["-c", SCENARIO])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["protections"]["work_dir_quota"] and report["protections"]["tmp_inode_quota"]
    assert report["read_inside"] == "from the host" and report["read_by_host"] == "from the command\n"
    assert report["host_directory"] == [], "the files live in the server's namespace, not on the host's disk"
    assert report["host_paths_seen"] == report["host_paths_seen_after_reset"] == []
    assert "No space left" in report["fill"], "the working directory holds at most disk_bytes"
    assert "No space left" in report["files"], "the working directory holds at most `inodes` files"
    assert report["timed_out"] and report["after_timeout"] == "from the command\n"
    assert "working directory" in report["server_lost"], "a lost server is an error, not an empty directory"


# One bwrap per command, unprivileged: what the host and its commands see of the working directory, as JSON.
PER_COMMAND = """
import dataclasses, json, os
from tests.sandbox.helpers import host_paths_seen
from trajlab.sandbox import Sandbox, SandboxLimits
limits = SandboxLimits(disk_bytes=1 << 20, inodes=64, file_size_bytes=4 << 20)
with Sandbox(limits, reuse_namespaces=False) as box:
    report = {"protections": dataclasses.asdict(box.protections())}
    box.write_file("task/input.txt", "from the host")
    report["read_inside"] = box.run("cat task/input.txt; echo from the command > out.txt").stdout
    report["read_by_host"] = box.read_file("out.txt").decode()
    report["host_paths_seen"] = host_paths_seen(box)
    report["fill"] = box.run("head -c 2000000 /dev/zero > big; stat -c %s big").stderr
    report["files"] = box.run("rm big; i=0; while : > f$i; do i=$((i+1)); done").stderr
    report["host_directory"] = os.listdir(box.path)
    path = str(box.path)
report["left"] = os.path.exists(path)
print(json.dumps(report))
"""


def test_one_bwrap_per_command_gets_a_working_directory_quota_too() -> None:
    done = run_as_nobody(["-c", PER_COMMAND])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["protections"]["work_dir_quota"]
    assert report["read_inside"] == "from the host" and report["read_by_host"] == "from the command\n"
    assert "No space left" in report["fill"], "the working directory holds at most disk_bytes"
    assert "No space left" in report["files"], "the working directory holds at most `inodes` files"
    assert report["host_directory"] == [], "the files live in the namespace's tmpfs, not on the host's disk"
    assert report["host_paths_seen"] == []
    assert not report["left"]
