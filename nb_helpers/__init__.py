"""Helpers for the QLoRA-on-4-GB notebook course. Notebooks import from the modules explicitly:

    from nb_helpers.config import RunConfig, default_config
    from nb_helpers.models import resolve_model, load_4bit
    ...
"""

import logging

from nb_helpers.fast.plan_terms import register_with_planner
from nb_helpers.hub import decide_offline

__version__ = "0.1.0"

decide_offline()  # before any hub library reads HF_HUB_OFFLINE at its import: without the Hub, fail fast from the cache
register_with_planner()  # the planner models the fast path where a config asks for it, without importing it (plan.engine)

# bitsandbytes on AVX512-BF16 CPUs suggests `pip install kernels`, which would fetch an inference-only kernel from the
# Hugging Face Hub. Training does not use it (models.keep_cpu_weights_trainable), so the hint only confuses; every
# other bitsandbytes message still shows.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(lambda record: "kernels-community" not in record.getMessage())
