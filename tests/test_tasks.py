"""kvgate/tasks.py: loops and stops that survive a swallowed cancellation."""

from __future__ import annotations

import asyncio

import httpx

from kvgate.serving import free_port
from kvgate.tasks import cancel_and_wait, stopping


async def _swallowing_loop(rounds: list[int], check: bool) -> None:
    """An advisory loop whose every round may fail, as a health check's does; the first cancellation is
    turned into an ordinary error, as a client library can do to one that arrives mid-connect."""
    swallowed = False
    while not (check and stopping()):
        rounds.append(1)
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True  # the library's error, caught below as the loop catches any round's error
        except Exception:
            pass


async def test_a_loop_that_checks_stopping_ends_after_one_swallowed_cancel() -> None:
    rounds: list[int] = []
    task = asyncio.create_task(_swallowing_loop(rounds, check=True))
    await asyncio.sleep(0.05)
    task.cancel()  # once, as asyncio.Runner does when it closes its loop
    await asyncio.wait_for(asyncio.wait({task}), 2)
    assert task.done()


async def test_without_the_check_one_cancel_is_not_enough_but_cancel_and_wait_is() -> None:
    rounds: list[int] = []
    task = asyncio.create_task(_swallowing_loop(rounds, check=False))
    await asyncio.sleep(0.05)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done  # the failure this module exists for: the loop ran on
    await asyncio.wait_for(cancel_and_wait(task), 5)
    assert task.cancelled()


async def test_cancel_and_wait_does_not_raise_the_tasks_own_error() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    await cancel_and_wait(None)


async def test_a_cancelled_connect_is_still_a_stop_for_a_checking_loop() -> None:
    """The real case: a loop of health checks against an address nothing answers, cancelled once
    while it connects, ends whatever the client library made of the cancellation."""
    url = f"http://127.0.0.1:{free_port()}/health"

    async def health_loop() -> None:
        async with httpx.AsyncClient(timeout=0.5) as client:
            while not stopping():
                try:
                    await client.get(url)
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0)

    task = asyncio.create_task(health_loop())
    for _ in range(20):
        await asyncio.sleep(0.003)
        if task.done():
            break
        task.cancel()
        await asyncio.wait_for(asyncio.wait({task}), 3)
        assert task.done()
        task = asyncio.create_task(health_loop())
    await cancel_and_wait(task)
