"""``trajlab serve`` and ``trajlab traces export``: record black-box agents, then turn their sessions into
trajectories."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from trajlab.cli.common import ConfigFile, Sets, config_options, console, load, setting, usage_error
from trajlab.cli.rollouts import PLACEMENT_OPTIONS
from trajlab.errors import require


@config_options("serve.upstream", "serve.port", "serve.host", "serve.served_model_name", "serve.record_dir",
                "rollout.parser", "serve.max_batch_size", "serve.max_body_bytes",
                ("serve.body_timeout_s", "--body-timeout"), "serve.prefix_cache_mb", "serve.default_max_tokens",
                "serve.max_context", *PLACEMENT_OPTIONS)
def serve_command(
    model: Annotated[Path | None, typer.Option(help="Model directory to serve (default: the config's model.path).")] = (
        None),
    config: ConfigFile = None,
    sets: Sets = None,
    *,
    given: dict[str, Any],
) -> None:
    """Serve a model over an OpenAI-compatible API and record every session's calls with exact token ids.

    Settings come from the config's serve section (the model served: its model section, the parser: rollout.parser);
    with serve.upstream set, the model section is not read.
    """
    require("uvicorn", feature="trajlab serve", install="pip install 'trajlab[serve]'")

    from trajlab.proxy.http import run_server
    from trajlab.proxy.server import build_app

    settings = load(config, sets, given | {"model.path": str(model) if model else None})
    server = settings.serve
    if server.upstream is not None and (model is not None or server.served_model_name is not None):
        raise usage_error("--upstream forwards to a server that serves its own model (serve.upstream): drop --model "
                          "and --served-model-name (serve.served_model_name); the model section, --parser, "
                          "--max-batch-size, --prefix-cache-mb, --default-max-tokens and --max-context do not apply "
                          "either.")
    server_app = build_app(server, settings.model, settings.rollout.parser)
    console.print(f"Serving {server.upstream or settings.model.path} on http://{server.host}:{server.port}/v1; "
                  f"recording sessions to {server.record_dir}/")
    run_server(server_app, server.host, server.port)


traces_app = typer.Typer(help="Recorded `trajlab serve` sessions: export them as trajectories.", no_args_is_help=True)


@traces_app.command("export")
def traces_export(
    out: Annotated[Path, typer.Option(help="Trajectory file (JSONL); appended to, ids already there are kept.")],
    tokenizer: Annotated[Path, typer.Option(help="The served model's directory (its tokenizer and chat template).")],
    record_dir: Annotated[Path | None, setting("serve.record_dir")] = None,
    session: Annotated[list[str] | None, typer.Option(help="Session id to export; repeatable (default: all).")] = None,
    env: Annotated[str, typer.Option(help="The trajectories' env field.")] = "recorded",
    reward: Annotated[str | None, typer.Option(help="Score each trajectory with 'module:function' (returns a "
                                               "float, or (float, success)); unscored ones are failures.")] = None,
    choice: Annotated[int, typer.Option(min=0, help="Which choice of each call extends the history.")] = 0,
    all_choices: Annotated[bool, typer.Option(help="Also export every other choice of n > 1 calls as a fork.")] = False,
    drop_if: Annotated[list[str] | None, typer.Option(help="Drop auxiliary calls: KEY=REGEX with KEY system, tools, "
                                                      "model or endpoint (e.g. 'tools=^$'); repeatable.")] = None,
):
    """Rebuild trajectories from session recordings: calls that extend a conversation merge, edited ones fork."""
    from trajlab.chat.template import resolve_chat_template
    from trajlab.models.loading import load_processor, load_tokenizer
    from trajlab.proxy.export import DropRule, export_sessions, load_reward, session_files

    recordings = load(None, None, {"serve.record_dir": str(record_dir) if record_dir else None}).serve.record_dir
    rules = [DropRule.parse(rule) for rule in drop_if or []]
    score = load_reward(reward) if reward else None
    loaded = load_tokenizer(tokenizer)
    paths = session_files(recordings, session)
    # Sessions that held images need the model's processor; a tokenizer-only directory still exports text sessions.
    processor = load_processor(tokenizer) if (tokenizer / "config.json").is_file() else None
    summary = export_sessions(paths, out, loaded, resolve_chat_template(loaded), env=env, reward=score,
                              choice=choice, all_choices=all_choices, drop=rules, processor=processor)
    console.print(f"Exported {summary['written']} trajectories to {out} from {summary['sessions']} sessions "
                  f"({summary['calls']} calls, {summary['samples']} samples; {summary['already']} already there, "
                  f"{summary['dropped']} calls dropped, {summary['skipped']} skipped)")
