"""Logging set-up for the command line, and quieting the libraries we call."""

import logging
import warnings

from mooncake.env import log_level, offline_hub


def setup_logging() -> None:
    logging.basicConfig(level=log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    offline_hub()
    warnings.filterwarnings("ignore", module="transformers")
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
