"""How long a 10,000-trajectory report takes to build and to open in Chromium, and how big it is.

    python benchmarks/report_open.py --run runs/quickstart          # after `bash scripts/quickstart.sh`
    python benchmarks/report_open.py --run runs/quickstart --screenshots docs/   # the docs' pictures

The report is of the quickstart's run directory (its config, stages, evaluations, curves and 6,400 trajectories:
demonstrations, evaluation episodes, RL rollouts with trainer logprobs), plus copies of those trajectories under new
ids up to ``--trajectories``. Each repeat opens the file in a fresh headless Chromium (Debian's chromium and
chromium-driver, through selenium) and reads the page's own mark of its first render (milliseconds since navigation
began: reading 25 MB, parsing the JSON, drawing the curves and the first page of the list). Then, in the open page,
a filter (status = failure) and opening a trajectory with its token view are timed.

No peer is measured beside it: none of the viewers of the field (Open Trajectory Gym's HTML browser, verl's and
SkyRL's tracker tables) runs offline on a trajectory file here. The target is the issue's: open in under 3 s, under
50 MB.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

from trajlab.data.store import TrajectoryStore, read_trajectories
from trajlab.report import write_report
from trajlab.report.browser import chromium, console_errors, open_report
from trajlab.report.build import TRAJECTORY_FILES

FILTER_JS = """
const started = performance.now(), status = document.getElementById("f-status");
status.value = "failure"; status.dispatchEvent(new Event("change"));
return [performance.now() - started, document.getElementById("count").textContent];
"""
OPEN_JS = """
const started = performance.now();
document.querySelector("#list tbody tr").click();
return [performance.now() - started, document.querySelectorAll("#detail .tok").length];
"""


def scaled_copies(run: Path, total: int, out: Path) -> int:
    """Copies of the run's trajectories under new ids, so that the run and the copies make ``total``; returns how
    many model tokens a trajectory has on average."""
    found = [t for pattern in TRAJECTORY_FILES for path in sorted(run.glob(pattern)) for t in read_trajectories(path)]
    if not found:
        raise SystemExit(f"no trajectories in {run}: run `bash scripts/quickstart.sh` first")
    with TrajectoryStore(out) as store:
        for n, trajectory in zip(range(total - len(found)), itertools.cycle(found), strict=False):
            store.append(trajectory.model_copy(update={"id": f"{trajectory.id}#copy{n}"}))
    tokens = [len(t.tokens.completion_ids) + len(t.tokens.prompt_ids) for t in found if t.tokens is not None]
    return round(statistics.mean(tokens))


SHOTS = {
    "report.png": "",  # the top: the evaluations side by side, what each training stage fixed and broke
    "report-curves.png": "document.getElementById('training').scrollIntoView()",  # the headline curves, smoothed
    # the first RL rollout that failed with an advantage on its turns, opened on its token view
    "report-tokens.png": """
        const select = document.getElementById("f-status"); select.value = "failure";
        select.dispatchEvent(new Event("change"));
        detail(shown.find((t) => t.source === "rl" &&
          Object.entries(t.metrics).some(([k, v]) => k.startsWith("advantage/") && v !== 0)));
        document.querySelector("#detail h3:last-of-type").scrollIntoView();""",
}


def screenshots(run: Path, folder: Path) -> None:
    """The run's own report as the docs show it (docs/evaluation.md): the top, the learning curves, and an RL
    rollout's tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    with chromium(width=1400, height=1000) as driver:
        open_report(driver, run / "report.html")
        for name, script in SHOTS.items():
            if script:
                driver.execute_script(script)
            driver.save_screenshot(str(folder / name))
        if errors := console_errors(driver):
            raise SystemExit(f"console errors: {errors}")
    print(f"wrote {', '.join(str(folder / name) for name in SHOTS)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=Path("runs/quickstart"))
    parser.add_argument("--trajectories", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--screenshots", type=Path, help="also save the run's report as the docs show it")
    args = parser.parse_args()
    if not (args.run / "config.yaml").exists():
        raise SystemExit(f"{args.run} is no run directory: run `bash scripts/quickstart.sh` first")
    if args.screenshots:
        screenshots(args.run, args.screenshots)

    with tempfile.TemporaryDirectory(prefix="trajlab-report-open-") as tmp:  # 24 MB of copies: never left behind
        work = Path(tmp)
        copies = work / "copies.jsonl"
        tokens = scaled_copies(args.run, args.trajectories, copies)
        page = work / "report.html"
        builds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            write_report([args.run, copies], page, max_trajectories=args.trajectories)
            builds.append(time.perf_counter() - started)
        opened, filtered, detail = [], [], []
        for _ in range(args.repeats):
            with chromium() as driver:
                opened.append(open_report(driver, page) / 1000)
                filter_ms, count = driver.execute_script(FILTER_JS)
                open_ms, shown_tokens = driver.execute_script(OPEN_JS)
                filtered.append(filter_ms / 1000)
                detail.append(open_ms / 1000)
                if errors := console_errors(driver):
                    raise SystemExit(f"console errors: {errors}")
        print(f"report of {args.trajectories} trajectories ({tokens} tokens each on average): "
              f"{page.stat().st_size / 1e6:.1f} MB")
        print(f"build (trajlab report):   median {statistics.median(builds):.2f} s  runs {_runs(builds)}")
        print(f"open in Chromium:         median {statistics.median(opened):.2f} s  runs {_runs(opened)}")
        print(f"filter status=failure:    median {statistics.median(filtered):.3f} s  ({count})")
        print(f"open a trajectory:        median {statistics.median(detail):.3f} s  ({shown_tokens} tokens drawn)")


def _runs(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":
    main()
