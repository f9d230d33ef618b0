"""Recipes: each stage wired from the library's components, and the Python API.

``collect``, ``evaluate``, ``sft``, ``rl`` and ``evolve`` (one module each, the function of the same name being
``trajlab.<name>``) build what their stage needs from what a user has in hand (names, paths, settings) and hand the
built objects to the components; ``pipeline`` runs them stage by stage for ``trajlab run``. This is the top layer
of the library: nothing below imports a recipe, and only the command line sits above.
"""
