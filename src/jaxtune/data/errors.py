"""The one exception the data pipeline raises for bad input."""


class DataError(ValueError):
    """Bad data input. The message names where (``file:line``, ``data.sources[1]``, a config key) and what to do."""
