"""The roles of a rank's threads (torchft_like.manager.threads)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from torchft_like.manager import threads


def role_in_new_thread(take: str | None = None) -> str:
    seen: list[str] = []

    def run() -> None:
        if take is not None:
            threads.take(take)
        seen.append(threads.role())

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    return seen[0]


@pytest.mark.parametrize("taken", [None, threads.QUORUM, threads.LOOP])
def test_a_thread_has_the_role_it_took_and_the_users_threads_are_training(taken):
    assert role_in_new_thread(taken) == (taken or threads.TRAINING)
    assert threads.role() == threads.TRAINING  # the test's own thread is untouched


def test_the_quorum_threads_initializer_gives_them_their_role():
    with ThreadPoolExecutor(1, initializer=threads.start_quorum_thread, initargs=(False,)) as ex:
        assert ex.submit(threads.role).result(10) == threads.QUORUM


@pytest.mark.parametrize(
    ("on", "allowed", "refused"),
    [
        (threads.TRAINING, (threads.TRAINING,), False),
        (threads.QUORUM, (threads.TRAINING,), True),  # start_quorum from the quorum thread
        (threads.LOOP, (threads.QUORUM,), True),  # a blocking transfer on the loop
        (threads.LOOP, (threads.QUORUM, threads.LOOP), False),
    ],
)
def test_check_refuses_a_call_on_a_thread_of_another_role(on, allowed, refused):
    errors: list[Exception] = []

    def run() -> None:
        threads.take(on)
        try:
            threads.check(*allowed, what="the entry point")
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=run, name="the-thread")
    t.start()
    t.join(10)
    assert bool(errors) == refused
    if refused:
        assert f"not on the {on} thread (the-thread)" in str(errors[0])
        assert "the entry point runs on the" in str(errors[0])
