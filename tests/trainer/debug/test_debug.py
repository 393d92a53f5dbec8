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


async def test_a_window_sees_the_stalls_inside_it_and_leaves_the_step_maximum_alone():
    inst = StallInstrument()
    trio.lowlevel.add_instrument(inst)
    try:
        await trio.lowlevel.checkpoint()  # the instrument times task steps from here on
        time.sleep(0.3)  # noqa: ASYNC251 - a stall before the windows
        await trio.lowlevel.checkpoint()
        with inst.window() as quiet:
            await trio.to_thread.run_sync(time.sleep, 0.3)  # off the loop: no stall
        with inst.window() as outer:
            with inst.window() as inner:
                time.sleep(0.1)  # noqa: ASYNC251 - a stall inside both windows
                await trio.lowlevel.checkpoint()
        step_max = inst.take_max_ms()
    finally:
        trio.lowlevel.remove_instrument(inst)
    assert step_max >= 300  # the stall before the windows still counts for the step
    assert quiet.max_ms < inner.max_ms == outer.max_ms < step_max
    assert inner.max_ms >= 100
