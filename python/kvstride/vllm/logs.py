"""kvstride's log lines inside vLLM go through vLLM's logging configuration: the same handler,
format (process name and pid, level, time, file and line), stream and level as vLLM's own
lines, so that kvstride's INFO lines (the staging pool's size, the bytes pinned) show where
vLLM's do. Where vLLM configures no logging (``VLLM_CONFIGURE_LOGGING=0``), kvstride's lines
go where Python's logging sends them, as before."""

from __future__ import annotations

import logging

__all__ = ["through_vllm_logging"]


class _ThroughVllm(logging.Handler):
    """Hands each record to vLLM's logger as it is configured at the time (vLLM may configure
    its logging again after kvstride is imported), else to the root logger."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if not target.handlers:
            target = logging.getLogger()
        if record.levelno >= target.getEffectiveLevel():
            target.handle(record)


def through_vllm_logging() -> None:
    """Route the ``kvstride`` loggers through vLLM's (once per process)."""
    ours = logging.getLogger("kvstride")
    if any(isinstance(handler, _ThroughVllm) for handler in ours.handlers):
        return
    ours.addHandler(_ThroughVllm())
    ours.setLevel(logging.DEBUG)  # the level that counts is the target's
    ours.propagate = False
