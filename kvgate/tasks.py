"""Background loops that stop when asked, even when a library they await swallowed the request.

A cancellation is one ``CancelledError`` delivered at one ``await``. Client libraries sometimes turn
it into their own error (a connect that was cancelled surfaces as ``ConnectError('All connection
attempts failed')``); a ``while True`` loop that catches that error, as every advisory loop here
must, then runs on for ever, and whoever awaits it — a server's stop, the test runner closing its
loop — waits for ever too (a test suite hung 30 minutes on a health loop that way). The task still
counts the request (``Task.cancelling()``), so a loop that checks it at each round ends, and a stop
that cancels again until the task is done returns.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_S = 1.0
"""How long a stop waits before asking again."""


def stopping() -> bool:
    """True once this task has been asked to stop (and has not withdrawn the request)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and return once it has ended, asking again every ``RECANCEL_S`` should the first
    request be lost. The task's own error, if it failed, is not raised: a stop is not where it is
    reported. Cancelling the caller cancels the wait, not the stop's promise: the task is cancelled."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved
