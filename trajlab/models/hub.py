"""Models by Hugging Face name: ``Qwen/Qwen3-1.7B`` resolves to its snapshot in the standard Hugging Face cache; and
pushing a model or dataset to the Hub (:func:`push_to_hub`).

Every loader takes a local directory; a name is turned into one here, once, with huggingface_hub's own cache logic
(``HF_HUB_CACHE``, ``HF_HOME``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` mean what they mean to ``hf download``). A name
already in the cache resolves without the network; one that is not is downloaded where the network allows, and
otherwise the error says how to get it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import transformers  # noqa: F401  (imported before huggingface_hub, whose lazy imports otherwise warn of a cycle)
from huggingface_hub import HfApi, constants, get_token, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from trajlab.errors import UserError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""What a Hugging Face model name looks like: ``org/name``."""

SKIPPED = ["original/*", "*.pth", "*.gguf", "*.onnx", "*.msgpack", "*.h5"]
"""Files a download leaves out: other frameworks' copies of the weights (Llama repositories also hold Meta's
``original/`` checkpoint), which transformers never reads."""


def resolve_model_dir(name_or_path: str | Path, what: str = "model") -> Path:
    """The local directory of ``name_or_path``: an existing directory as it is, a Hugging Face name as its snapshot
    in the Hugging Face cache (downloaded first when it is not cached and the network allows).

    Raises:
        NotADirectoryError: the path is a file.
        FileNotFoundError: neither a directory nor a model that is cached or can be downloaded; the message says how
            to fix it.
    """
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"cannot load {what}: {path} is a file, not a model directory")
    name = str(name_or_path)
    if not REPO_ID.fullmatch(name):
        raise FileNotFoundError(f"cannot load {what}: {name!r} does not exist. Give a model directory (e.g. one "
                                "made by `trajlab model init <dir>`) or a Hugging Face model name such as "
                                "Qwen/Qwen3-1.7B.")
    try:
        return Path(snapshot_download(name, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        why = "the network is off (HF_HUB_OFFLINE)"
    else:
        try:
            return Path(snapshot_download(name, ignore_patterns=SKIPPED))
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
            why = f"downloading it failed: {' '.join(str(exc).split())[:300]}"
    raise FileNotFoundError(
        f"cannot load {what}: {name!r} is no local directory, and no model of that name is in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}); {why}. Download it where the network allows with `hf download {name}` (the "
        "same cache, or set HF_HUB_CACHE to where it is), or give a model directory."
    )


def hub_token() -> str:
    """The Hugging Face token huggingface_hub finds (``HF_TOKEN``, else the one ``hf auth login`` stored).

    Raises:
        UserError: there is none; the message says how to give one.
    """
    token = get_token()
    if token is None:
        raise UserError("no Hugging Face token to push with: set HF_TOKEN to a token with write access "
                        "(https://huggingface.co/settings/tokens) or run `hf auth login`, then push again.")
    return token


def push_to_hub(path: str | Path, repo: str, *, repo_type: Literal["model", "dataset"], private: bool,
                message: str) -> str:
    """Upload a folder (every file in it) or one file to the Hub repository ``repo``, created if it does not exist;
    returns the commit's URL. ``HF_ENDPOINT`` points huggingface_hub at another Hub.

    Raises:
        UserError: no token (:func:`hub_token`), a name that is no repository id, or the Hub refused (the message
            quotes it).
    """
    if not REPO_ID.fullmatch(repo):
        raise UserError(f"{repo!r} is no Hugging Face repository id: give one as user-or-org/name.")
    api = HfApi(token=hub_token())
    path = Path(path)
    try:
        api.create_repo(repo, repo_type=repo_type, private=private, exist_ok=True)
        if path.is_dir():
            commit = api.upload_folder(folder_path=path, repo_id=repo, repo_type=repo_type, commit_message=message)
        else:
            commit = api.upload_file(path_or_fileobj=path, path_in_repo=path.name, repo_id=repo, repo_type=repo_type,
                                     commit_message=message)
    except HfHubHTTPError as exc:
        raise UserError(f"pushing {path} to {repo} failed: {' '.join(str(exc).split())[:300]}") from exc
    return commit.commit_url
