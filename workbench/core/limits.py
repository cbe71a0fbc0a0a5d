"""User code with a time limit: reward functions and evaluation hooks.

A function the user names (`module:function`) may hang: a network call that never returns, a
lock, an infinite loop. Run inside `call_with_limit`, it gets `seconds`; past them the run stops
with a UserError naming the function, the step and what it was called on, instead of waiting
until the collective timeout on the other ranks. Python cannot kill a thread, so the call runs
in a daemon thread that is abandoned on a timeout; the run is stopping anyway.

    value = call_with_limit(fn, kwargs, 300, "reward function 'mine:score' at step 12 on 16 completions")
"""

from __future__ import annotations

import threading

from workbench.core.errors import UserError


class UserCodeTimeout(UserError):
    """A user function ran past its time limit."""


def call_with_limit(fn, kwargs: dict, seconds: float | None, what: str):
    """fn(**kwargs) within `seconds` (None or <= 0: no limit); its exception is re-raised as is."""
    if not seconds or seconds <= 0:
        return fn(**kwargs)
    box: dict = {}

    def target():
        try:
            box["value"] = fn(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            box["error"] = exc

    worker = threading.Thread(target=target, name=f"limited: {what[:40]}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise UserCodeTimeout(f"{what} did not return within {seconds:g} s; fix it or raise its time limit")
    if "error" in box:
        raise box["error"]
    return box.get("value")
