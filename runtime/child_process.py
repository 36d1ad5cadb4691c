"""kvserve's child processes (the engine core, tensor-parallel workers, API servers): how a child's exit is
described in errors, and one clear error for a script that builds a multi-process engine at module level
without an `if __name__ == "__main__":` guard.

With the spawn start method every child process re-imports the parent's main script (as `__mp_main__`); an
unguarded `LLM(..., tensor_parallel_size=2)` there would start processes again from each child, and Python
answers with its raw "An attempt has been made to start a new process before the current process has finished
its bootstrapping phase", once per child. Instead the child leaves silently with MAIN_GUARD_EXIT_CODE and the
parent, which sees that exit code, raises MainGuardError once, saying what to change.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

MAIN_GUARD_EXIT_CODE = 87

MAIN_GUARD_MESSAGE = (
    "kvserve starts child processes (the engine core, tensor-parallel workers) with the 'spawn' method, which "
    "re-imports your main script in each child; the script builds the engine at module level, so each child "
    'would start it again. Put the code that creates the engine under `if __name__ == "__main__":` '
    "(see https://docs.python.org/3/library/multiprocessing.html#the-spawn-and-forkserver-start-methods)"
)


class MainGuardError(RuntimeError):
    def __init__(self, message: str = MAIN_GUARD_MESSAGE):
        super().__init__(message)


def exit_if_bootstrapping() -> None:
    """Call before starting a child process. In a child that is still importing the parent's main script,
    leave at once with MAIN_GUARD_EXIT_CODE (the parent turns it into MainGuardError)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        os._exit(MAIN_GUARD_EXIT_CODE)


def raise_if_main_guard_exit(exitcode: int | None) -> None:
    if exitcode == MAIN_GUARD_EXIT_CODE:
        raise MainGuardError()


def describe_exit(code: int | None) -> str:
    """A child's exitcode (multiprocessing's convention: negative = killed by that signal) for an error message."""
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def start_with_signals_blocked(proc, signals) -> None:
    """proc.start() with `signals` blocked in the child from its first instruction: the signal mask survives
    fork and exec, so a stop signal that reaches the child while it is still importing (a cgroup stop reaches
    every process at once) stays pending until the child installs its handler and unblocks it, instead of
    killing it with the default action halfway through start-up (CPython protects its resource tracker the same
    way, bpo-33613). The tracker is started first: starting it unblocks SIGINT/SIGTERM again in this thread."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
