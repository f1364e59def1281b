"""What several test modules share, one module per idea; fixtures stay in tests/conftest.py. A test module imports
from here (``from helpers.tiny_runs import ...``), never from another test module or from conftest.

``helpers`` is a top-level name: there is no tests/__init__.py, so pytest (its default ``prepend`` import mode) puts
tests/, the folder of conftest.py, on ``sys.path`` before it imports conftest, under ``pytest`` and
``python -m pytest`` alike, from any directory.
"""
