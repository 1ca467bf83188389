"""The main thread's wait for a stop (cosyvoice.system.signals): a SIGTERM the kernel hands to another thread of
the process (it may pick any thread that does not block it) still stops the wait. An unbounded ``Event.wait()``
slept through one: the web UI never began its drain (a CI run of test_page_files timed out waiting for its exit)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import signal, sys, threading
    from cosyvoice.system.signals import wait_in_main_thread

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = threading.Event()

    def elsewhere():
        started.wait()
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # this thread's, not the main thread's

    threading.Thread(target=elsewhere, daemon=True).start()
    try:
        started.set()
        {wait}
    except KeyboardInterrupt:
        print("stopped", flush=True)
""")


@pytest.mark.parametrize("wait", ["wait_in_main_thread()", "wait_in_main_thread(threading.Event())"])
def test_a_signal_delivered_to_another_thread_stops_the_main_threads_wait(wait: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(wait=wait)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0 and done.stdout == "stopped\n", done.stderr


def test_the_set_event_ends_the_wait() -> None:
    from threading import Event, Timer

    from cosyvoice.system.signals import wait_in_main_thread

    event = Event()
    Timer(0.05, event.set).start()
    wait_in_main_thread(event)
    assert event.is_set()
