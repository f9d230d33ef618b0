"""What every command shares: the console, errors, and settings read through the config models.

A command's settings are fields of the pydantic config (:mod:`trajlab.config`): an option declared with
:func:`setting` takes its help text and shown default from the field, and the values given on the command line,
``--set KEY=VALUE`` items and a ``--config`` file are merged and validated by one loader, so a command and a
run config's stage share every default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from trajlab.config import PipelineConfig, load_config

console = Console(emoji=False)  # episode ids hold ":train:", which rich would print as an emoji


class ErrorsAsMessages(TyperGroup):
    """Prints a user's mistake (a bad file, name, setting or server) as one line and exits 1; usage errors stay 2.

    Set ``TRAJLAB_DEBUG=1`` to see the traceback instead.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except (ValueError, OSError, ModuleNotFoundError) as exc:  # UserError, ValidationError, missing files
            if os.environ.get("TRAJLAB_DEBUG"):
                raise
            # messages quote user input: no markup in them; soft_wrap keeps one line however narrow the terminal
            console.print(f"[bold red]error:[/] {escape(_message(exc))}", soft_wrap=True)
            raise typer.Exit(code=1) from exc


def _message(exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError):
        return (f"the '{exc.name}' package is not installed ({exc}); install it (`pip install -e '.[test]'` "
                "installs every optional feature)")
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)


def usage_error(message: str) -> typer.Exit:
    """A wrong combination of options: said in one line, exit 2 like click's own usage errors."""
    console.print(f"[bold red]usage error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code=2)


def _field(path: str) -> Any:
    """The pydantic field behind a dotted config path, e.g. ``eval.num_tasks``."""
    model: Any = PipelineConfig
    *sections, leaf = path.split(".")
    for name in sections:
        model = model.model_fields[name].annotation
    return model.model_fields[leaf]


def setting(path: str, *flags: str, **option: Any) -> Any:
    """A typer option for the config field at ``path``: its help text and default come from the field.

    The option's own default is None ("not given"), so only what the user typed overrides the config.
    """
    field = _field(path)
    default = field.get_default(call_default_factory=True)
    shown = "" if default is None else f" [config: {path}, default: {default}]"
    return typer.Option(*flags, help=(field.description or "") + (shown or f" [config: {path}]"),
                        show_default=False, **option)


ConfigFile = Annotated[Path | None, typer.Option(
    "--config", help="A run config (YAML): its sections give this command's settings; options override it.")]
ReportTo = Annotated[list[str] | None, setting("report_to", "--report-to")]
Sets = Annotated[list[str] | None, typer.Option(
    "--set", help="Override any config key, e.g. --set rollout.max_turns=4 (value read as YAML); repeatable.")]


def load(config: Path | None, sets: list[str] | None, given: dict[str, Any]) -> PipelineConfig:
    """The effective config: the file (or defaults), then ``--set`` items, then options given on this command.

    ``given`` maps dotted config paths to option values; None means the option was not given.
    """
    overrides = parse_sets(sets)
    for path, value in given.items():
        if value is not None:
            _put(overrides, path, value)
    return load_config(config, overrides)


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as nested overrides (values read as YAML)."""
    import yaml

    overrides: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise usage_error(f"--set takes KEY=VALUE (e.g. rl.steps=5), got {item!r}.")
        _put(overrides, key, yaml.safe_load(value))
    return overrides


def _put(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value
