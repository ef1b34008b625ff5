"""Helpers for the QLoRA-on-4-GB notebook course. Notebooks import from the modules explicitly:

    from nb_helpers.config import RunConfig, default_config
    from nb_helpers.models import resolve_model, load_4bit
    ...
"""

__version__ = "0.1.0"
