"""AttachedCoreClient: a CoreClient for one of several API-server processes sharing one engine core
(`kvserve serve --api-server-count N`, runtime/server/api_server_group.py). The launcher started the core;
this process only binds its own input/output socket pair and stamps its `client_index` on every request,
so the core routes this server's outputs back here.

Liveness without being the core's parent: a pidfd (os.pidfd_open) of the core becomes readable when the
core exits, like a multiprocessing sentinel, so SIGKILL of the core is seen at once (EngineDeadError:
every request answered 503, /health 503, this server exits 1). The exit status belongs to the launcher,
the core's real parent, which logs it. Shutting this client down closes its sockets; it never stops the
core (the other API servers still use it): the launcher does, once every API server is gone.
"""

from __future__ import annotations

import logging
import os
import select
import weakref
from dataclasses import dataclass

from kvserve.runtime.config import EngineConfig
from kvserve.runtime.engine.core_client import DEFAULT_STARTUP_TIMEOUT_S, CoreClient, close_channel
from kvserve.runtime.tokenizer import load_tokenizer

logger = logging.getLogger("kvserve.engine.client")


@dataclass(frozen=True)
class CoreAttachment:
    """What the launcher tells API server `client_index` (picklable: it crosses a spawn)."""

    client_index: int
    input_address: str
    output_address: str
    core_pid: int


class _CoreProcessHandle:
    """The subset of multiprocessing.Process CoreClient uses, for a process this one did not start."""

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self.sentinel = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: a pipe whose write end is closed reads as "exited"
            r, w = os.pipe()
            os.close(w)
            self.sentinel = r
        self.exitcode = None  # unknown here: only the parent (the launcher) can wait for it

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        select.select([self.sentinel], [], [], timeout)

    def close(self) -> None:
        try:
            os.close(self.sentinel)
        except OSError:
            pass


class AttachedCoreClient(CoreClient):
    owns_core_process = False

    def __init__(
        self, config: EngineConfig, attachment: CoreAttachment, startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    ):
        self.tokenizer = load_tokenizer(config.model.model_dir)
        self.client_index = attachment.client_index
        self.proc = _CoreProcessHandle(attachment.core_pid)
        self._open_sockets(attachment.input_address, attachment.output_address)
        self._finalizer = weakref.finalize(
            self, _close, self.proc, self._input, self._output, self._ctx, (self._wake_r, self._wake_w)
        )
        self._await_core(startup_timeout_s)
        logger.info("API server %d attached to engine core %d", self.client_index, self.core_pid)

    def _describe_core_exit(self) -> str:
        return f"pid {self.proc.pid} exited; the launcher logs its exit status"


def _close(proc: _CoreProcessHandle, input_sock, output_sock, ctx, fds: tuple[int, int]) -> None:
    """Never raises. Sockets and fds only: the core belongs to the launcher."""
    close_channel((input_sock, output_sock), ctx, fds)
    proc.close()
