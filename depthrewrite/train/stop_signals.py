"""Stopping a training run cleanly on SIGTERM or SIGINT.

A cluster that preempts or times out a job sends SIGTERM and, a grace period later,
SIGKILL; Ctrl-C sends SIGINT. Without handling, the steps since the last ``save_every``
are lost. While :class:`StopRequests` is active, the first such signal only records the
request: the loop finishes the step it is in, saves a checkpoint and stops
(``loop.TrainingInterrupted``). A second signal is delivered as if nothing were installed
(SIGINT raises ``KeyboardInterrupt``, SIGTERM ends the process), for a stop that cannot
wait for the step.

Handlers can only be installed from the main thread; elsewhere the signals keep their
handlers and a debug message says so.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)

#: the signals that ask a run to stop
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """Context manager: while active, :attr:`requested` is the name of the first stop
    signal received (``"SIGTERM"``), else None."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if not self.enabled:
            return self
        if threading.current_thread() is not threading.main_thread():
            log.debug("stop signals: not in the main thread, SIGTERM and SIGINT keep their handlers")
            return self
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = name
            log.warning("received %s: the run stops after the current step and saves a checkpoint (send it again "
                        "to stop at once, without saving)", name)
            return
        # a second signal: what it would have done without us
        self._restore()
        signal.raise_signal(signum)
