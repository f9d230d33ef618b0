"""The ``trajlab`` command line: a thin typer layer over the recipes (:mod:`trajlab.recipes`), the Python API.

Each command module holds one group of jobs; this module only assembles the app. A user's mistake is one line on
the console and exit code 1; a wrong combination of options is a usage error, exit code 2.
"""

from __future__ import annotations

from typing import Annotated

import typer

from trajlab.cli import report, rollouts, serving, setup, training
from trajlab.cli.common import ErrorsAsMessages, usage_error
from trajlab.cli.output import Verbosity, configure

app = typer.Typer(help="Post-train LLMs to use tools across many turns.", no_args_is_help=True,
                  pretty_exceptions_enable=False, cls=ErrorsAsMessages)


@app.callback()
def main(
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only results, warnings and errors: no progress, no "
                                        "account of each stage.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug records, the libraries' info records and "
                                          "progress bars, every warning.")] = False,
) -> None:
    """Post-train LLMs to use tools across many turns."""
    if quiet and verbose:
        raise usage_error("--quiet and --verbose contradict each other; give one.")
    configure(Verbosity.QUIET if quiet else Verbosity.VERBOSE if verbose else Verbosity.NORMAL)


app.command()(setup.envs)
app.add_typer(setup.model_app, name="model")
app.add_typer(setup.config_app, name="config")
app.command("collect")(rollouts.collect_command)
app.add_typer(rollouts.eval_app, name="eval")
app.command("dataset")(training.dataset_command)
app.command("sft")(training.sft_command)
app.command("rl")(training.rl_command)
app.command("evolve")(training.evolve_command)
app.command("run")(training.run_command)
app.command()(report.report)
app.command("serve")(serving.serve_command)
app.add_typer(serving.traces_app, name="traces")

__all__ = ["app"]
