"""Recipes: the stages wired from components (collect into a trajectory file, the ``trajlab run`` pipeline).

Nothing below this layer imports a recipe; the Python API (:mod:`trajlab.api`) and the command line sit on top.
"""
