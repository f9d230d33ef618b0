"""``trajlab envs``, ``trajlab model init|push`` and ``trajlab config show``: what there is to run, and with what."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from trajlab.cli.common import ConfigFile, Sets, console, load, setting, usage_error

model_app = typer.Typer(help="Build, inspect and publish models.", no_args_is_help=True)
config_app = typer.Typer(help="Show the effective configuration.", no_args_is_help=True)


def envs(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
    docs: Annotated[Path | None, typer.Option(help="Write a Markdown page per env (tools from their schemas).")] = None,
    config: ConfigFile = None,
    sets: Sets = None,
) -> None:
    """List the registered environments, their tools and default episode limits; with an mcp: section (in --config
    or --set), also the MCP server's tools as the env 'mcp'."""
    from trajlab.env.registry import load_env, registered_names
    from trajlab.errors import MissingDependency

    if docs is not None:
        from trajlab.env.docs import write_env_docs

        for page in write_env_docs(docs):
            typer.echo(page)
        return
    rows = []
    for name in registered_names():
        try:
            spec = load_env(name)
        except MissingDependency as exc:  # listed all the same, with what to install
            rows.append({"name": name, "unavailable": str(exc)})
            continue
        rows.append({"name": name, "description": spec.description, "tools": spec.tools,
                     "limits": spec.limits.model_dump(), "knobs": [asdict(knob) for knob in spec.knobs],
                     "references": sorted(spec.references)})
    settings = load(config, sets, {}).mcp if config is not None or sets else None
    if settings is not None:
        spec = settings.spec()  # a server that cannot start is the user's error, said in one line
        rows.append({"name": "mcp", "description": spec.description, "tools": spec.tools,
                     "limits": spec.limits.model_dump(), "knobs": [], "references": []})
        spec.env_cls.server.close()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table("env")
    table.add_column("description", overflow="fold")  # fold, never cut: an unavailable env's install command
    table.add_column("tools")
    table.add_column("default limits")
    table.add_column("difficulty knobs")
    for row in rows:
        if "unavailable" in row:
            table.add_row(row["name"], f"[yellow]unavailable:[/] {escape(row['unavailable'])}", "", "", "")
            continue
        tools = "\n".join(f"{t['function']['name']}({', '.join(t['function']['parameters'].get('properties', {}))})"
                          for t in row["tools"])
        limits = "\n".join(f"{key} {value:g}" for key, value in row["limits"].items())
        knobs = "\n".join(f"{k['name']} {k['default']} ({k['low']}-{k['high']})" for k in row["knobs"])
        described = row["description"] + (f"\nimperfect references: {', '.join(row['references'])}"
                                          if row["references"] else "")
        table.add_row(row["name"], described, tools, limits, knobs)
    console.print(table)


@model_app.command("init")
def model_init(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model and tokenizer to.")],
    seed: Annotated[int | None, setting("model.init_seed", "--seed")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing model directory.")] = False,
    vision: Annotated[bool, typer.Option(help="Build the tiny vision-language model (Gemma 3 architecture, with "
                                              "its image processor) instead of the text one.")] = False,
    arch: Annotated[str | None, typer.Option(help="Build a random twin of a public model instead: its real "
                                                  "configuration and tokenizer (qwen3-0.6b, qwen3-1.7b, "
                                                  "qwen2.5-0.5b, llama-3.2-1b).")] = None,
    layers: Annotated[int | None, typer.Option(min=1, help="With --arch: decoder layers (default: the real "
                                                           "model's depth).")] = None,
) -> None:
    """Build the tiny offline default model (Qwen3 architecture + byte-level BPE tokenizer) in seconds; with --vision,
    the tiny vision-language model (Gemma 3 architecture, its processor and the same tokenizer plus image tokens);
    with --arch, a randomly initialised model of a public model's real configuration with its real tokenizer."""
    if arch is not None and vision:
        raise usage_error("--arch builds a text model; --vision the tiny vision-language one: give one.")
    if layers is not None and arch is None:
        raise usage_error("--layers sets the depth of an --arch model; give --arch too.")
    seed = load(None, None, {"model.init_seed": seed}).model.init_seed
    started = time.perf_counter()
    try:
        path, kind = _init_model(out_dir, seed=seed, overwrite=overwrite, vision=vision, arch=arch, layers=layers)
    except FileExistsError as exc:
        raise ValueError(str(exc)) from exc
    elapsed = time.perf_counter() - started
    console.print(f"Wrote {kind} ({_parameters(path) / 1e6:.2f}M parameters) to {path} in {elapsed:.1f}s")


@model_app.command("push")
def model_push(
    model_dir: Annotated[Path, typer.Argument(help="A model directory, e.g. a run's rl/final or sft/final.")],
    repo: Annotated[str, typer.Option(help="The Hub model repository to push to, user-or-org/name (created if "
                                           "missing).")],
    private: Annotated[bool, typer.Option(help="Create the repository private.")] = False,
) -> None:
    """Push a trained model directory to the Hugging Face Hub; needs a token with write access (HF_TOKEN, or `hf
    auth login`)."""
    from trajlab.models.hub import push_to_hub

    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir}: not a model directory (no config.json); give a trained model's folder, e.g. "
                         "RUN/rl/final.")
    url = push_to_hub(model_dir, repo, repo_type="model", private=private, message=f"Upload {model_dir.name} with "
                      "trajlab")
    console.print(f"Pushed {model_dir} to {repo}: {url}")


def _init_model(out_dir: Path, *, seed: int, overwrite: bool, vision: bool, arch: str | None,
                layers: int | None) -> tuple[Path, str]:
    """The model directory written, and what it holds in words."""
    if arch is not None:
        from trajlab.models.archs import arch_config, init_arch_model

        depth = arch_config(arch, layers).num_hidden_layers  # an unknown name fails here, before anything is written
        return (init_arch_model(arch, out_dir, layers=layers, seed=seed, overwrite=overwrite),
                f"{arch} twin, {depth} layers, random weights")
    from trajlab.models.tiny import init_tiny

    return init_tiny(out_dir, seed=seed, vision=vision, overwrite=overwrite)


def _parameters(path: Path) -> int:
    """Parameters saved in a model directory, read from the safetensors headers (a real-depth twin is not loaded
    again just to be counted); tied weights are saved, and counted, once."""
    from safetensors import safe_open

    total = 0
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as tensors:
            names = tensors.keys()  # a safe_open handle is not iterable
            total += sum(math.prod(tensors.get_slice(name).get_shape()) for name in names)
    return total


@config_app.command("show")
def config_show(
    config: Annotated[Path | None, typer.Argument(help="A run config (YAML); none: the defaults.")] = None,
    sets: Sets = None,
) -> None:
    """Print the effective configuration, every default included, as YAML that `trajlab run` accepts back."""
    import yaml

    settings = load(config, sets, {})
    typer.echo(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False), nl=False)
