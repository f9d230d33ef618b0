"""The shipped real-model configs, each run on its 1-layer real-architecture twin with tiny budgets.

Every stage of each config runs as shipped (its env, stages, rates, limits, dataset and RL settings) except what the
budgets change: the model is ``trajlab model init --arch NAME --layers 1`` (real widths, vocabulary and tokenizer,
random weights), with one demonstration, one SFT step, one RL step of 1 task x 2 rollouts and evaluations of one task.
The twin is in bfloat16 where the CPU has bfloat16 units to carry the 150k-vocabulary head, in float32 where it has
none: an AVX2 host emulates bfloat16, and its SFT step of the Llama twin ran more than 20 minutes (33 s in float32).
The demonstration is collected first with the config's own rollout limits (a shorter limit would truncate it); the
other stages then roll out 2 turns of 8 tokens, since the random twin writes nonsense until a limit stops it. One
layer, not two: the time goes into the decoder layers' compute on the ~4.5k-token BFCL episodes and into writing
checkpoints (the embedding dominates the parameters either way). Measured on a 2-core CPU with bfloat16 units, the
Llama config took 160 s with 2 layers and 125 s with 1; on a 2-core AVX2 host in float32, 132 s (Qwen3: 108 s).
Peak memory about 12 GB for the Qwen3-1.7B twin in bfloat16, most of it the SFT step, and 10.4 GB in float32.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trajlab.data.store import read_trajectories
from trajlab.models.devices import cpu_has_bfloat16_units

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"qwen3-1.7b-bfcl.yaml": "qwen3-1.7b", "llama3.2-1b-bfcl.yaml": "llama-3.2-1b"}
BUDGETS = {"sft.max_steps": 1, "sft.gradient_accumulation_steps": 1, "rl.steps": 1, "rl.tasks_per_step": 1,
           "rl.group_size": 2, "eval.num_tasks": 1, "rollout.max_turns": 2, "rollout.max_new_tokens": 8,
           "rollout.concurrency": 2}
DTYPE = "bfloat16" if cpu_has_bfloat16_units() else "float32"


def _trajlab(*args: str) -> subprocess.CompletedProcess:
    """One command in its own process (each run's memory is its own), from the repository root."""
    return subprocess.run([sys.executable, "-m", "trajlab.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=1200, env=os.environ | {"COLUMNS": "200"})


def _sets(values: dict) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


# The twin, SFT's checkpoint and final model, RL's, in float32: 11.0 GB measured for the Llama twin (323M parameters);
# the Qwen3 twin has 361M, so about 12.3 GB.
TWIN_DISK_GB = 12.5


@pytest.fixture
def scratch(tmp_path):
    """tmp_path, emptied after the test: a run writes 11-12.3 GB of checkpoints (float32 weights and optimizer state
    of a 323M- or 361M-parameter twin), which pytest would otherwise keep for three sessions. The two twins run one
    after the other (heaviest first, tests/conftest.py, puts both at the head of one worker's share). A full disk
    said only "No space left on device" from safetensors, in the middle of the run."""
    free = shutil.disk_usage(tmp_path).free / 1e9
    assert free >= TWIN_DISK_GB, (f"{tmp_path.parent} has {free:.1f} GB free; the twin's run needs about "
                                  f"{TWIN_DISK_GB:g} GB: free some space or point --basetemp elsewhere")
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.slow(250)
def test_shipped_config_runs_on_its_one_layer_twin(name, scratch):
    config = ROOT / "configs" / name
    shipped = yaml.safe_load(config.read_text())
    assert config.read_text().startswith(f"# trajlab run configs/{name}\n")
    twin, run = scratch / "twin", scratch / "run"
    built = _trajlab("model", "init", "--arch", CONFIGS[name], "--layers", "1", str(twin))
    assert built.returncode == 0, built.stdout + built.stderr
    model = {"run_dir": run, "model.path": twin, "model.dtype": DTYPE, "collect.episodes": 1}

    demonstrated = _trajlab("run", str(config), *_sets(model), "--set", "stages=[collect]")
    assert demonstrated.returncode == 0, demonstrated.stdout + demonstrated.stderr
    (demo,) = read_trajectories(run / "demos.jsonl")
    assert demo.status == "success" and demo.env == "bfcl"
    if shipped["collect"].get("reference") == "one_call_at_a_time":
        assert all(len(m.get("tool_calls") or []) <= 1 for m in demo.messages)

    result = _trajlab("run", str(config), *_sets(model | BUDGETS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["label"] for r in json.loads((run / "results.json").read_text())] == ["base", "sft", "rl"]
    for stage in ("sft", "rl"):
        trained = json.loads((run / stage / "final" / "config.json").read_text())
        assert trained["num_hidden_layers"] == 1 and trained["dtype"] == DTYPE
    used = yaml.safe_load((run / "config.yaml").read_text())
    assert used["sft"]["learning_rate"] == shipped["sft"]["learning_rate"] == 1e-5
    assert used["rl"]["learning_rate"] == shipped["rl"]["learning_rate"] == 1e-6
    assert used["stages"] == shipped["stages"] and used["env"] == "bfcl"
    steps = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and steps[0]["optim/lr"] > 0
