"""The one error the export raises for bad input: a message naming the problem and the fix, no traceback."""

from nb_helpers.config import ConfigError


class ExportError(ConfigError):
    """A model, adapter, file kind or tool the export cannot handle; the message names the fix."""
