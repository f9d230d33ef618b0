"""``trajlab serve`` and ``trajlab traces export``: record black-box agents, then turn their sessions into
trajectories."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trajlab.cli.common import console, load, setting, usage_error
from trajlab.errors import require


def serve(
    model: Annotated[Path | None, typer.Option(help="Model directory to serve (with --backend).")] = None,
    upstream: Annotated[str | None, typer.Option(
        help="Instead of --model: forward to this OpenAI-compatible server (e.g. http://127.0.0.1:8001/v1) and "
             "record in between.")] = None,
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Interface to bind; 0.0.0.0 exposes the server to the network.")] = (
        "127.0.0.1"),
    served_model_name: Annotated[str | None, typer.Option(help="Name clients pass as `model` (default: the "
                                                          "model directory's name).")] = None,
    record_dir: Annotated[Path, typer.Option(help="One JSONL file of call records per session.")] = Path(
        "runs/serve/sessions"),
    parser: Annotated[str | None, setting("rollout.parser")] = None,
    max_batch_size: Annotated[int, typer.Option(min=1, help="Most generations batched together.")] = 32,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="Larger request bodies get 413.")] = 4 << 20,
    body_timeout: Annotated[float, typer.Option(min=0.001, help="Seconds a request body may take to arrive; then "
                                                "408.")] = 30.0,
    prefix_cache_mb: Annotated[int, typer.Option(min=0, help="Memory (MiB) for key/value states kept between a "
                                                 "session's calls (hf backend); bounds the server's memory.")] = 1024,
    device: Annotated[str | None, setting("model.device")] = None,
    dtype: Annotated[str | None, setting("model.dtype")] = None,
    backend: Annotated[str | None, setting("model.backend")] = None,
):
    """Serve a model over an OpenAI-compatible API and record every session's calls with exact token ids."""
    uvicorn = require("uvicorn", feature="trajlab serve", install="pip install 'trajlab[serve]'")

    from trajlab.config import RolloutSettings
    from trajlab.proxy.server import ServeConfig, build_app

    if upstream is not None and (model is not None or served_model_name is not None):
        raise usage_error("--upstream forwards to a server that serves its own model: drop --model and "
                    "--served-model-name (--parser, --max-batch-size, --device and --dtype do not apply either).")
    placed = load(None, None, {"model.device": device, "model.dtype": dtype, "model.backend": backend}).model
    config = ServeConfig(model=model, upstream=upstream, served_model_name=served_model_name, record_dir=record_dir,
                         parser=parser or RolloutSettings().parser, max_batch_size=max_batch_size,
                         max_body_bytes=max_body_bytes, body_timeout_s=body_timeout,
                         prefix_cache_bytes=prefix_cache_mb << 20, device=placed.device, dtype=placed.dtype,
                         backend=placed.backend)
    server_app = build_app(config)
    console.print(f"Serving {model or upstream} on http://{host}:{port}/v1; recording sessions to {record_dir}/")
    uvicorn.run(server_app, host=host, port=port, log_level="warning")


traces_app = typer.Typer(help="Recorded `trajlab serve` sessions: export them as trajectories.", no_args_is_help=True)


@traces_app.command("export")
def traces_export(
    out: Annotated[Path, typer.Option(help="Trajectory file (JSONL); appended to, ids already there are kept.")],
    tokenizer: Annotated[Path, typer.Option(help="The served model's directory (its tokenizer and chat template).")],
    record_dir: Annotated[Path, typer.Option(help="Directory of the session files.")] = Path("runs/serve/sessions"),
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

    rules = [DropRule.parse(rule) for rule in drop_if or []]
    score = load_reward(reward) if reward else None
    loaded = load_tokenizer(tokenizer)
    paths = session_files(record_dir, session)
    # Sessions that held images need the model's processor; a tokenizer-only directory still exports text sessions.
    processor = load_processor(tokenizer) if (tokenizer / "config.json").is_file() else None
    summary = export_sessions(paths, out, loaded, resolve_chat_template(loaded), env=env, reward=score,
                              choice=choice, all_choices=all_choices, drop=rules, processor=processor)
    console.print(f"Exported {summary['written']} trajectories to {out} from {summary['sessions']} sessions "
                  f"({summary['calls']} calls, {summary['samples']} samples; {summary['already']} already there, "
                  f"{summary['dropped']} calls dropped, {summary['skipped']} skipped)")
