"""What every command shares: the console, errors, and settings read through the config models.

A command's settings are fields of the pydantic config (:mod:`trajlab.config`): an option declared with
:func:`setting` takes its help text and shown default from the field, and the values given on the command line,
``--set KEY=VALUE`` items and a ``--config`` file are merged and validated by one loader, so a command and a
run config's stage share every default.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import click
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from trajlab.config import ConfigError, PipelineConfig, load_config
from trajlab.config.pipeline import read_yaml, yaml_problem

Command = TypeVar("Command", bound=Callable[..., Any])
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
            console.print(f"[bold red]error:[/] {escape(printable(_message(exc)))}", soft_wrap=True)
            raise typer.Exit(code=1) from exc


def _message(exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError):
        return (f"the '{exc.name}' package is not installed ({exc}); install it (`pip install -e '.[test]'` "
                "installs every optional feature)")
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)


def printable(text: str) -> str:
    """``text`` with the bytes of a non-UTF-8 argument (Python keeps them as lone surrogates, which no terminal
    encoding can print) written as ``\\xff``."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


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
    """A typer option for the config field at ``path``: its help text, shown default and bounds (``ge``/``le``, a
    usage error when crossed) come from the field.

    The option's own default is None ("not given"), so only what the user typed overrides the config.
    """
    field = _field(path)
    default = field.get_default(call_default_factory=True)
    shown = "" if default is None else escape(f" [config: {path}, default: {default}]")  # rich markup otherwise
    bounds = {name: getattr(rule, attr) for rule in field.metadata for name, attr in (("min", "ge"), ("max", "le"))
              if getattr(rule, attr, None) is not None}
    return typer.Option(*flags, help=(field.description or "") + (shown or escape(f" [config: {path}]")),
                        show_default=False, **(bounds | option))


ConfigOption = str | tuple[str, str]
"""A config path (``rollout.max_turns`` is ``--max-turns``), or a path and the flag that names it on the command line
(``("rollout.tool_timeout_s", "--tool-timeout")``)."""


def config_options(*options: ConfigOption) -> Callable[[Command], Command]:
    """Give a command one option per config path, each a view of its field (:func:`setting`); the command receives
    what the user typed as ``given`` (dotted path -> value, None: not given), for :func:`load`. Commands declare the
    options they share (rollout limits, placement) by their paths instead of repeating a block of parameters."""

    def decorate(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        names: dict[str, str] = {}
        added = []
        for option in options:
            path, flags = (option, ()) if isinstance(option, str) else (option[0], option[1:])
            name = flags[0].lstrip("-").replace("-", "_") if flags else path.rpartition(".")[2]
            names[name] = path
            added.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                           annotation=Annotated[_option_type(path) | None, setting(path, *flags)]))

        @functools.wraps(command)
        def with_given(*args: Any, **kwargs: Any) -> Any:
            given = {path: kwargs.pop(name) for name, path in names.items()}
            return command(*args, **kwargs, given=given)

        kept = [parameter for name, parameter in signature.parameters.items() if name != "given"]
        with_given.__signature__ = signature.replace(parameters=kept + added)
        return with_given

    return decorate


def _option_type(path: str) -> Any:
    """The command-line type of a config field: its value type without validators, None or choices (a list stays a
    list of its items)."""
    return _value_type(_field(path).annotation)


def _value_type(kind: Any) -> Any:
    if get_origin(kind) is Annotated:
        return _value_type(get_args(kind)[0])
    if get_origin(kind) in (Union, UnionType):
        return _value_type(next(arg for arg in get_args(kind) if arg is not type(None)))
    if get_origin(kind) is Literal:
        return type(get_args(kind)[0])
    if get_origin(kind) is list:
        return list[_value_type(get_args(kind)[0])]
    return kind


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
    """``--set KEY=VALUE`` items as nested overrides (values read as YAML).

    Raises:
        ConfigError: an item that is not UTF-8 text, or whose value is not YAML.
    """
    import yaml

    overrides: dict[str, Any] = {}
    for item in items or []:
        if printable(item) != item:
            raise ConfigError(f"--set {printable(item)}: not UTF-8 text; give keys and values in UTF-8.")
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise usage_error(f"--set takes KEY=VALUE (e.g. rl.steps=5), got {item!r}.")
        try:
            parsed = read_yaml(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item}: the value is not valid YAML: {yaml_problem(exc)}") from exc
        _put(overrides, key, parsed)
    return overrides


def _put(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value
