"""``python -m trajlab.cli``: the same app as the ``trajlab`` command."""

from trajlab.cli import app

app()
