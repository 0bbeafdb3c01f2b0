"""An engine with nothing to compute but loading requests waits for news from the transfer workers: a
lookup answered or a load landed. Requests that only wait for pages bring none, so it sleeps instead of
stepping in a loop until their deadline."""

import threading

from kvtierd.tiers.transfer import TransferQueue, TransferStats


def test_the_wait_sleeps_until_a_finished_lookup_makes_a_waiter_ready():
    queue = TransferQueue(lambda *_: None, 1, TransferStats())
    ready: list[int] = []
    woke_ready: list[bool] = []  # whether a waiter was ready when the wait returned

    def wait() -> None:
        queue.wait(60.0, lambda: bool(ready))
        woke_ready.append(bool(ready))

    waiter = threading.Thread(target=wait, daemon=True)
    gate = threading.Event()

    def lookup() -> list:
        gate.wait()
        ready.append(1)
        return []

    try:
        waiter.start()  # nothing in flight and nobody ready: it sleeps (it used to return at once)
        queue.look_up(lookup)
        gate.set()
        waiter.join(60.0)
        assert woke_ready == [True]  # woken by the lookup's end, with its waiter ready
    finally:
        gate.set()
        queue.close()


def test_the_wait_returns_at_once_when_a_waiter_is_ready():
    queue = TransferQueue(lambda *_: None, 1, TransferStats())
    try:
        queue.wait(60.0, lambda: True)  # would block a minute otherwise
    finally:
        queue.close()
