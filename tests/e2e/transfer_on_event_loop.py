"""``python -m tests.e2e.transfer_on_event_loop ARGS``: ``python -m trainer ARGS`` done the wrong
way, with the weight transfer's fault (a slow transfer, ``sleep=S``) run on the trio thread, as
a transfer run on the event loop would (SkyRL #2524). tests/e2e/test_fully_async_cli.py shows
what that does to the rollouts in flight; the product has no switch for it.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import trio

import sync.transfer
from trainer.__main__ import main

_fire_in_its_thread = sync.transfer.fire_fault_sync


def _fire_on_the_event_loop(op: str, *args: Any, **kwargs: Any) -> None:
    """Called in the transfer's worker thread: the trio thread is held blocked for as long as
    the fault lasts (a helper thread holds it in ``Event.wait``), as if the fault ran there.
    The fault starts only once the trio thread is held, so the stall lasts the whole fault."""
    token = trio.from_thread.run_sync(trio.lowlevel.current_trio_token)
    held, over = threading.Event(), threading.Event()

    def hold() -> None:  # runs on the trio thread
        held.set()
        over.wait()

    holder = threading.Thread(
        target=trio.from_thread.run_sync, args=(hold,), kwargs={"trio_token": token}
    )
    holder.start()
    try:
        held.wait()
        _fire_in_its_thread(op, *args, **kwargs)
    finally:
        over.set()
        holder.join()


if __name__ == "__main__":
    sync.transfer.fire_fault_sync = _fire_on_the_event_loop
    sys.exit(main(sys.argv[1:]))
