"""Every claim only a GPU can settle, in one command: RL step, rollouts, async RL, SFT and update memory.

    bash benchmarks/gpu/run.sh                  # on the GPU machine (installs the gathered wheels first)
    python benchmarks/gpu/run.py --smoke        # the whole script on a CPU at tiny sizes, in a few minutes

Each measurement runs in its own fresh interpreter, one after the other, the peer first inside each, and the results
land in ``<out>/results.json`` and ``<out>/results.md`` after every one of them, so a run cut short keeps what it
measured; models and runs go to ``--work-dir``. A measurement that fails is recorded with its error and the rest go
on. ``--budget-s`` bounds the whole run: the measurement running when it is spent is stopped, later ones are not
started (the table says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Scale, progress, scale_from_json  # noqa: E402  (a script beside its modules)

MEASUREMENTS = ("rl_step", "rollouts", "async_rl", "sft", "update_memory")
NEEDED = ("trajlab", "transformers", "torch", "trl", "datasets", "pydantic", "accelerate", "typer", "rich")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def missing_packages() -> list[str]:
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    return missing


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in NEEDED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # trajlab run from its source tree
            out[name] = "source"
    return out


def device_facts(device: str) -> dict[str, Any]:
    import torch

    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        return {"device": props.name, "memory_gb": round(props.total_memory / 2**30, 1),
                "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}
    return {"device": f"CPU ({os.cpu_count()} cores)"}


def commit() -> str:
    result = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (result.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def run_one(name: str, scale: Scale, work: Path, timeout_s: float) -> dict[str, Any]:
    """``name``'s ``measure`` in a fresh interpreter; its result, or what went wrong."""
    result_file = work / f"{name}.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--one", name, "--scale", json.dumps(dataclasses.asdict(scale)),
               "--work", str(work)]
    began = time.perf_counter()
    # its own process group: on a timeout its workers (and their GPU memory) go with it
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=timeout_s)
        status = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        status = "timeout"
    seconds = time.perf_counter() - began
    if status == 0 and result_file.exists():
        return {"status": "ok", "seconds": seconds, **json.loads(result_file.read_text())}
    tail = stderr or ""
    sys.stderr.write(tail[-4000:])
    return {"status": "failed", "seconds": seconds, "error": f"exit {status}", "stderr_tail": tail[-4000:]}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU measurements: {report['facts']['device']}", "",
             f"commit {report['commit']}, {report['date']}; command `{report['command']}`", "",
             "versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             f"model: {report['scale']['arch']} ({report['scale']['shape']}), "
             f"vocabulary {report['scale']['vocab_size']:,}, random weights, {report['scale']['dtype']}", ""]
    for name in MEASUREMENTS:
        result = report["results"].get(name)
        lines.append(f"## {name}")
        if result is None:
            lines.append("not run (budget spent or not selected)")
        elif result["status"] != "ok":
            lines.append(f"FAILED after {result['seconds']:.0f} s: {result['error']}")
        else:
            lines.append(importlib.import_module(name).table(result))
            lines.append(f"\n({result['seconds']:.0f} s)")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script, not the claims")
    parser.add_argument("--arch", default="qwen3-0.6b", choices=("qwen3-0.6b", "qwen3-1.7b"))
    parser.add_argument("--only", default=",".join(MEASUREMENTS), help="comma-separated subset, run in this order")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_bench"), help="results.json and results.md")
    parser.add_argument("--work-dir", type=Path, help="models and runs (default: <out>/work); reused when present")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="the whole run's time: no measurement starts after it, and the one running then is "
                             "stopped (the H100 window is 7 minutes)")
    parser.add_argument("--one", choices=("prepare", *MEASUREMENTS), help=argparse.SUPPRESS)
    parser.add_argument("--scale", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.only = [name for name in args.only.split(",") if name]
    unknown = sorted(set(args.only) - set(MEASUREMENTS))
    if unknown:
        parser.error(f"unknown measurement(s) {unknown}; choose from {list(MEASUREMENTS)}")
    return args


def child(args: argparse.Namespace) -> None:
    """Inside a measurement's own interpreter."""
    scale = scale_from_json(args.scale)
    if args.one == "prepare":
        from common import warm_started_model

        warm_started_model(scale, args.work)
        (args.work / "prepare.json").write_text("{}")
        return
    result = importlib.import_module(args.one).measure(scale, args.work)
    (args.work / f"{args.one}.json").write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one:
        child(args)
        return
    missing = missing_packages()
    if missing:
        raise SystemExit("missing packages: " + "; ".join(missing) + ". On the GPU machine run benchmarks/gpu/run.sh "
                         "with the wheels gathered here first by `bash benchmarks/gpu/gather_wheels.sh`.")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no GPU visible to torch: the full run measures GPU claims; use --smoke to check the script "
                         "on a CPU")
    scale = Scale.for_smoke() if args.smoke else Scale.full(args.arch)
    out = args.out.resolve()
    work = (args.work_dir or out / "work").resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "versions": versions(),
              "facts": device_facts(scale.device), "scale": {**dataclasses.asdict(scale), "dtype": scale.dtype},
              "results": {}}
    began = time.perf_counter()
    progress(f"{report['facts']['device']}: preparing the {scale.arch} model in {work}")
    prepared = run_one("prepare", scale, work, timeout_s=args.budget_s)
    report["prepare_s"] = prepared["seconds"]
    for name in args.only if prepared["status"] == "ok" else []:
        left = args.budget_s - (time.perf_counter() - began)
        if left <= 0:
            progress(f"budget of {args.budget_s:.0f} s spent: {name} and the rest not run")
            break
        progress(f"{name}: starting ({left:.0f} s of budget left)")
        report["results"][name] = run_one(name, scale, work, timeout_s=left)
        progress(f"{name}: {report['results'][name]['status']} in {report['results'][name]['seconds']:.0f} s")
        write_report(report, out)
    report["total_s"] = time.perf_counter() - began
    print(write_report(report, out))
    failed = [name for name, result in report["results"].items() if result["status"] != "ok"]
    if prepared["status"] != "ok" or failed:
        raise SystemExit(f"failed: {['prepare'] if prepared['status'] != 'ok' else failed}; see {out}")


def write_report(report: dict[str, Any], out: Path) -> str:
    """results.json and results.md, rewritten after every measurement so a run cut short keeps what it measured."""
    text = markdown(report)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(text)
    return text

if __name__ == "__main__":
    main()
