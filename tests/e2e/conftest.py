from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def quiet_kvcanary_logger():
    """The CLI points the kvcanary loggers at its own handler; put them back after each test."""
    logger = logging.getLogger("kvcanary")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:], logger.propagate = handlers, propagate
    logger.setLevel(level)
