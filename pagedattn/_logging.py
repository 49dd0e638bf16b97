"""The 'pagedattn' logger: one stderr line per cold compile by default.

A record with extra={"partial": True} is printed without a newline and one with extra={"tail": True}
finishes that line, so a compile reads `pagedattn: compiling X for sm_90a (first use: ...; ~4 s, ...)... 4.1 s`.
"""
from __future__ import annotations

import logging
import sys

from . import envs


class _Formatter(logging.Formatter):
    def format(self, record):
        msg = record.getMessage()
        if getattr(record, "tail", False):
            return msg
        prefix = "pagedattn: " if record.levelno <= logging.INFO else f"pagedattn {record.levelname.lower()}: "
        return prefix + msg


class _LineHandler(logging.StreamHandler):
    def emit(self, record):
        self.terminator = "" if getattr(record, "partial", False) else "\n"
        self.stream = sys.stderr  # follow redirections made after import
        super().emit(record)


def setup() -> logging.Logger:
    logger = logging.getLogger("pagedattn")
    if not any(isinstance(h, _LineHandler) for h in logger.handlers):
        handler = _LineHandler()
        handler.setFormatter(_Formatter())
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(getattr(logging, envs.log_level(), logging.INFO))
    return logger
