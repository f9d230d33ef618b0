from __future__ import annotations

import pytest

from tests.evaluation.runs import run_a, run_b
from trajlab.evaluation import EvalReport, evaluate_trajectories


@pytest.fixture
def report_a() -> EvalReport:
    return evaluate_trajectories(run_a(), ks=(1, 2, 3), label="untrained")


@pytest.fixture
def report_b() -> EvalReport:
    return evaluate_trajectories(iter(run_b()), ks=(1,), label="sft")
