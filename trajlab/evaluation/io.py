"""Eval reports on disk: ``eval.json`` written atomically, and read back with errors that name the file."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

from trajlab.errors import UserError, refuse_special_file
from trajlab.evaluation.metrics import EvalReport


class ReportError(ValueError):
    """An eval report file is missing or not a valid report; the message names the file."""


def save_report(report: EvalReport, path: str | Path) -> Path:
    """Write ``report`` as indented JSON, atomically, so a crash never leaves a half-written ``eval.json``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return path


def load_report(path: str | Path) -> EvalReport:
    """Read a report written by :func:`save_report`.

    Raises:
        ReportError: the file is missing, not JSON, or not an eval report; the message names the file.
    """
    path = Path(path)
    try:
        refuse_special_file(path, "an eval report (eval.json, as `trajlab eval` writes)")
    except UserError as exc:
        raise ReportError(str(exc)) from None
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ReportError(f"{path}: no such eval report (write one with `trajlab eval`)") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot read eval report: {exc}") from exc
    try:
        return EvalReport.model_validate_json(text)
    except ValidationError as exc:
        errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")  # misspelled keys first
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in errors[:4])
        more = f" (and {len(errors) - 4} more)" if len(errors) > 4 else ""
        raise ReportError(f"{path}: not a valid eval report: {problems}{more}") from exc
