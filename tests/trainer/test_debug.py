"""The stall instrument sees blocking calls on the trio thread, and only those."""

from __future__ import annotations

import time

import trio

from trainer.debug import StallInstrument


async def test_a_blocking_call_on_the_loop_is_a_stall_and_a_thread_is_not():
    inst = StallInstrument()
    trio.lowlevel.add_instrument(inst)
    try:
        await trio.to_thread.run_sync(time.sleep, 0.3)  # off the loop
        off_loop = inst.take_max_ms()
        time.sleep(0.3)  # noqa: ASYNC251 - the blocking call under test
        await trio.lowlevel.checkpoint()
        on_loop = inst.take_max_ms()
    finally:
        trio.lowlevel.remove_instrument(inst)
    assert on_loop >= 300
    assert off_loop < on_loop
    assert inst.take_max_ms() == 0.0  # each window starts empty
