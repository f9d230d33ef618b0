"""The environment pages in docs/envs are the generated ones: tools documented exactly as the model sees them."""

from pathlib import Path

import pytest

from trajlab.env import load_env
from trajlab.env.docs import env_page, write_env_docs
from trajlab.env.registry import registered_names

DOCS = Path(__file__).resolve().parents[2] / "docs" / "envs"


@pytest.mark.parametrize("name", registered_names())
def test_committed_page_matches_the_env(name):
    page = DOCS / f"{name}.md"
    assert page.exists(), f"no page for '{name}': run `trajlab envs --docs docs/envs`"
    assert page.read_text() == env_page(load_env(name)), f"{page} is stale: run `trajlab envs --docs docs/envs`"


def test_every_tool_and_argument_is_on_its_page(tmp_path):
    write_env_docs(tmp_path)
    index = (tmp_path / "README.md").read_text()
    for name in registered_names():
        spec = load_env(name)
        page = (tmp_path / f"{name}.md").read_text()
        assert f"[`{name}`]({name}.md)" in index
        for tool in spec.tools:
            function = tool["function"]
            assert f"### `{function['name']}(" in page
            for argument in function["parameters"].get("properties", {}):
                assert f"| `{argument}` |" in page
