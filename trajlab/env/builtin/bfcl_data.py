"""BFCL's multi-turn data, function docs and executable backends, read from the installed ``bfcl-eval`` package.

Everything here works on objects the caller owns: backend instances are made per call of :func:`new_backends`
and calls run on the instances passed in. ``bfcl_eval``'s own executor (``execute_multi_turn_func_call``) keeps
instances in module globals keyed by model name and entry id, so two episodes of one entry would share state; it
is never used here. Its result formatting is reproduced in :func:`execute`.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import os
import tempfile
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Annotated, Any

from pydantic import SkipValidation

from trajlab.errors import require

# bfcl_eval's config module creates result folders under BFCL_PROJECT_ROOT (next to site-packages by default) when
# imported; point it at a per-process temp path first, so importing trajlab's env never writes into the venv.
os.environ.setdefault("BFCL_PROJECT_ROOT", os.path.join(tempfile.gettempdir(), f"trajlab-bfcl-{os.getpid()}"))

require("bfcl_eval", feature="The bfcl environment",
        install="pip install --no-deps bfcl-eval==2026.3.23 mpmath filelock (--no-deps: bfcl-eval declares about 150 "
                "dependencies it does not use)")

# isort: off
from bfcl_eval.constants.default_prompts import (  # noqa: E402 (re-exported for the env)
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
    MAXIMUM_STEP_LIMIT,
    PROMPT_STYLE_TEMPLATES,
)
from bfcl_eval.constants.executable_backend_config import (  # noqa: E402
    CLASS_FILE_PATH_MAPPING,
    MULTI_TURN_FUNC_DOC_FILE_MAPPING,
    STATELESS_CLASSES,
)
from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (  # noqa: E402 (re-exported for the env)
    response_checker,
    state_checker,
)
# isort: on

__all__ = ["DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC", "MAXIMUM_STEP_LIMIT", "PROMPT_STYLE_TEMPLATES",
           "response_checker", "state_checker"]

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
"""The four multi-turn categories, 200 entries each; entry i of every category shares its scenario."""

BACKEND_CLASSES = ("GorillaFileSystem", "MathAPI", "MessageAPI", "TwitterAPI", "TicketAPI", "TradingBot",
                   "TravelAPI", "VehicleControlAPI")
"""The executable backends the multi-turn categories use (bfcl_eval's mapping also lists memory and web search)."""

_DATA = resources.files("bfcl_eval") / "data"
_PYTHON_TYPES: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list,
                                 "object": dict}


@dataclass(frozen=True)
class Entry:
    """One BFCL multi-turn entry with its ground truth: one list of python-call strings per user turn."""

    id: str
    category: str
    index: int
    question: list[list[dict[str, str]]]  # per user turn, its messages; a held-out function's turn has none
    initial_config: dict[str, Any]
    involved_classes: list[str]
    missed_function: dict[int, list[str]]  # turn index -> names of the functions announced at that turn
    ground_truth: list[list[str]]


@dataclass(frozen=True)
class Call:
    """A function call by name with keyword arguments (ground-truth positional arguments are bound to names)."""

    name: str
    arguments: dict[str, Any]

    def source(self) -> str:
        """The call as python source, the form BFCL's checker executes (``cd(folder='document')``)."""
        return f"{self.name}({', '.join(f'{key}={value!r}' for key, value in self.arguments.items())})"


def entry_id(category: str, index: int) -> str:
    return f"multi_turn_{category}_{index}"


@cache
def entries(category: str) -> tuple[Entry, ...]:
    """The entries of one category in BFCL's order, joined with their ground truth."""
    if category not in CATEGORIES:
        raise ValueError(f"Unknown BFCL multi-turn category '{category}'; expected one of {list(CATEGORIES)}.")
    questions = _jsonl(f"BFCL_v4_multi_turn_{category}.json")
    answers = _jsonl(f"possible_answer/BFCL_v4_multi_turn_{category}.json")
    loaded = []
    for index, (row, answer) in enumerate(zip(questions, answers, strict=True)):
        if row["id"] != answer["id"] or row["id"] != entry_id(category, index):
            raise ValueError(f"bfcl_eval data out of order at {category} {index}: {row['id']} / {answer['id']}")
        loaded.append(Entry(
            id=row["id"], category=category, index=index, question=row["question"],
            initial_config=row.get("initial_config", {}), involved_classes=row["involved_classes"],
            missed_function={int(turn): names for turn, names in row.get("missed_function", {}).items()},
            ground_truth=answer["ground_truth"],
        ))
    return tuple(loaded)


def load_entry(task_id: str) -> Entry:
    """An entry by id, e.g. ``multi_turn_miss_func_12``."""
    prefix, _, index = task_id.rpartition("_")
    category = prefix.removeprefix("multi_turn_")
    if not prefix.startswith("multi_turn_") or category not in CATEGORIES or not index.isdigit():
        raise ValueError(f"'{task_id}' is not a BFCL multi-turn id like 'multi_turn_base_0' "
                         f"(categories: {', '.join(CATEGORIES)}).")
    rows = entries(category)
    if int(index) >= len(rows):
        raise ValueError(f"'{task_id}': category '{category}' has entries 0 to {len(rows) - 1}.")
    return rows[int(index)]


def _jsonl(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (_DATA / path).read_text().splitlines() if line.strip()]


# --- Function docs and their JSON schemas ---


@cache
def function_docs() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every backend function: name -> (backend class, BFCL's function doc). Names are unique across backends."""
    docs: dict[str, tuple[str, dict[str, Any]]] = {}
    for class_name in BACKEND_CLASSES:
        for doc in _jsonl(f"multi_turn_func_doc/{MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]}"):
            if doc["name"] in docs:
                raise ValueError(f"BFCL function '{doc['name']}' is in {docs[doc['name']][0]} and {class_name}.")
            docs[doc["name"]] = (class_name, doc)
    return docs


def functions_of(class_name: str) -> list[str]:
    return [name for name, (owner, _) in function_docs().items() if owner == class_name]


def tool_schema(doc: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function doc as a chat-template tool schema.

    Types follow bfcl_eval's own ``GORILLA_TO_OPENAPI`` table (``dict`` -> object, ``float`` -> number, ``tuple`` ->
    array, ``any`` -> string), recursively through ``properties`` and ``items``; a ``"None"`` default becomes null and
    the ``response`` description is dropped (tool schemas describe inputs only).
    """
    parameters = _convert(doc["parameters"])
    parameters.setdefault("properties", {})
    parameters.setdefault("required", [])
    return {"type": "function",
            "function": {"name": doc["name"], "description": doc["description"].strip(), "parameters": parameters}}


def _convert(spec: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "type":
            out[key] = GORILLA_TO_OPENAPI.get(value, "string")
        elif key == "properties":
            out[key] = {name: _convert(child) for name, child in value.items()}
        elif key == "items":
            out[key] = _convert(value)
        elif key == "description":
            out[key] = value.strip()
        elif key == "default":
            out[key] = None if value == "None" else value
        else:
            out[key] = copy.deepcopy(value)
    return out


def python_annotation(schema: dict[str, Any], optional: bool) -> Any:
    """The type hint a generated tool method declares for one argument.

    Values reach the backend exactly as the model sent them, as in BFCL (which ``eval``s the call): the hint is
    marked ``SkipValidation``, so pydantic only checks argument names, while transformers (TRL's tool schemas) still
    reads the plain type.
    """
    kind = _PYTHON_TYPES[schema.get("type", "string")]
    if kind is list and "items" in schema:
        item = _PYTHON_TYPES[schema["items"].get("type", "string")]
        kind = list[item]
    if optional:
        kind = kind | None
    return Annotated[kind, SkipValidation]


def tool_docstring(schema: dict[str, Any]) -> str:
    """A Google-style docstring carrying the schema's descriptions, for tools discovered from docstrings (TRL)."""
    function = schema["function"]
    lines = [_one_line(function["description"]), ""]
    properties = function["parameters"]["properties"]
    if properties:
        lines.append("Args:")
        lines += [f"    {name}: {_one_line(spec.get('description', '') or name)}" for name, spec in properties.items()]
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return " ".join(text.split())


# --- Backends and execution ---


@cache
def backend_class(class_name: str) -> type:
    return getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)


def new_backends(entry: Entry) -> dict[str, Any]:
    """Fresh instances of the entry's backend classes, loaded with its initial config, as BFCL's executor does."""
    instances = {}
    for class_name in entry.involved_classes:
        instance = backend_class(class_name)()
        if class_name not in STATELESS_CLASSES:
            instance._load_scenario(copy.deepcopy(entry.initial_config.get(class_name, {})),
                                    long_context=entry.category == "long_context")
        instances[class_name] = instance
    return instances


def execute(instance: Any, call: Call) -> str:
    """Run one call on a backend instance; the result as BFCL's executor records it.

    Strings stay as they are, dicts become JSON (or ``str`` if not serialisable), anything else ``str``; an exception
    becomes ``"Error during execution: <message>"``. The checker compares these strings. The arguments are copied:
    backends keep argument objects in their state (a tweet's ``mentions`` list) and later calls mutate them, so a call
    must never share them with another call, as BFCL's, which evaluates fresh literals, never does.
    """
    try:
        value = getattr(instance, call.name)(**copy.deepcopy(call.arguments))
    except Exception as exc:  # the backend's own error is the call's result, as in BFCL
        return f"Error during execution: {exc}"
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except Exception:  # BFCL falls back to str for dicts holding non-serialisable objects
            return str(value)
    return str(value)


def parse_call(source: str) -> Call:
    """A ground-truth call string (``sort('final_report.pdf')``) as name + keyword arguments.

    Arguments are python literals; positional ones are bound to parameter names with the backend's signature.
    """
    node = ast.parse(source.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"Not a plain function call: {source!r}")
    name = node.func.id
    args = [ast.literal_eval(arg) for arg in node.args]
    kwargs = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
    if args:
        method = getattr(backend_class(function_docs()[name][0]), name)
        bound = inspect.signature(method).bind(None, *args, **kwargs)  # None stands for self
        kwargs = {key: value for key, value in list(bound.arguments.items())[1:]}
    return Call(name, kwargs)


def held_out_functions(entry: Entry) -> dict[int, list[str]]:
    """``miss_func``'s held-out functions by the turn that announces them, minus any the ground truth calls earlier.

    One entry (``multi_turn_miss_func_49``) holds out ``tail`` until turn 3 but calls it in turn 1: BFCL can still
    run it there (its executor maps every method of the instance; only the doc is held out), whereas here a held-out
    function is unknown until announced, so such a function is offered from the start.
    """
    truth = ground_truth_calls(entry.id)
    held = {}
    for turn, names in entry.missed_function.items():
        early = {call.name for calls in truth[:turn] for call in calls}
        held[turn] = [name for name in names if name not in early]
    return held


@cache
def ground_truth_calls(task_id: str) -> tuple[tuple[Call, ...], ...]:
    """An entry's ground truth parsed: per user turn, its calls."""
    return tuple(tuple(parse_call(source) for source in turn) for turn in load_entry(task_id).ground_truth)


def method_signature(name: str) -> inspect.Signature:
    return inspect.signature(getattr(backend_class(function_docs()[name][0]), name))

