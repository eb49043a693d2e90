"""User-facing errors.

A `HeptiError` is a problem with the user's input or environment. The CLI prints its message
(which says what is wrong and how to fix it) and exits non-zero without a traceback. Anything
else is a bug and keeps its traceback.
"""


class HeptiError(Exception):
    """Bad input or environment; the message tells the user what to change."""


class ConfigError(HeptiError, ValueError):
    """A model config that hepti cannot run."""


class WeightsError(HeptiError):
    """Missing, corrupted or inconsistent converted weights."""


class InputError(HeptiError, ValueError):
    """Bad inference input (texts, ids, files, flags)."""


class PlanError(HeptiError, ValueError):
    """A ratio vector, plan or profile that cannot be used."""


class GraphError(HeptiError, ValueError):
    """An operator graph that cannot be read or ordered (not ONNX, a cycle, shapes unknown)."""
