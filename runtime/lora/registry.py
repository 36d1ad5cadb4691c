"""The adapters one engine core serves (name -> directory), and loading / unloading them at run time
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`).

The registry lives in the engine core, the one place every API server of a group reaches: a name is
served exactly when it is here. Loading reads, checks and hashes the files on the calling thread (never the
step loop's: core_process.py runs these calls on its utility thread, the in-process server on a pool
thread), then registers under `lock`, which the core also holds while a step runs the model -- so a
running step never sees a half-registered adapter, and a load waits at most one step to register.

Unloading a name that running or waiting requests still use takes the name out of service at once (new
requests get 404) and drops the weights when its last request finishes, so unloading never fails a
request in flight. A reload under the same name gets a new content identity (adapter.identity), which
seeds the prefix-cache chain, so blocks computed under the old weights are never reused.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Callable, Protocol

from kvserve.runtime.lora.adapter import LoraAdapter, LoraLoadError, load_peft_adapter
from kvserve.runtime.lora.errors import LoraRequestError

__all__ = ["AdapterStore", "LoraRegistry", "LoraRequestError"]


class AdapterStore(Protocol):
    """Where the model's adapters live, as the registry manages them: the in-process LoraManager
    (lora/manager.py), or every rank's under the multiprocess executor (executor/lora_calls.py)."""

    targets: set[str]  # the module names an adapter may target
    max_cpu_loras: int  # how many adapters it holds at most
    cpu: OrderedDict[str, LoraAdapter]  # loaded adapters by name (their identity keys the prefix cache)

    def check(self, adapter: LoraAdapter) -> None:
        """LoraLoadError if the adapter does not fit the model's modules."""

    def add(self, adapter: LoraAdapter) -> None: ...

    def remove(self, name: str) -> None: ...


class LoraRegistry:
    def __init__(
        self,
        manager: AdapterStore,
        max_lora_rank: int,
        modules: tuple[tuple[str, str], ...] = (),
        in_use: Callable[[str], int] = lambda name: 0,
    ):
        """in_use(name): unfinished requests of the core using that adapter (the core's own bookkeeping)."""
        self.manager = manager
        self.max_lora_rank = max_lora_rank
        self.paths: dict[str, str] = dict(modules)  # served names -> directory (what /v1/models lists)
        self.in_use = in_use
        self.lock = threading.Lock()
        self._loading: set[str] = set()
        self._unloading: set[str] = set()  # out of service; weights kept until their requests finish

    # -- requests -------------------------------------------------------------------------------------------
    def identity(self, name: str) -> str | None:
        """The loaded adapter's content identity, or None when `name` is not served."""
        with self.lock:
            if name not in self.paths:
                return None
            adapter = self.manager.cpu.get(name)
            return None if adapter is None else adapter.identity

    def adapters(self) -> dict[str, str]:
        with self.lock:
            return dict(self.paths)

    # -- load / unload (never on the step loop's thread) ----------------------------------------------------
    def load(self, name: str, path: str, load_inplace: bool = False) -> dict[str, str]:
        """Read, check and register one PEFT adapter; returns the served adapters. LoraRequestError when
        refused (nothing changes then)."""
        if not isinstance(name, str) or not name.strip():
            raise LoraRequestError(400, "lora_name", "invalid_value", "lora_name must be a non-empty string")
        if not isinstance(path, str) or not path.strip():
            raise LoraRequestError(400, "lora_path", "invalid_value", "lora_path must be a non-empty string")
        with self.lock:
            self._check_can_load(name, load_inplace)
            self._loading.add(name)
        try:
            if not os.path.isdir(path):
                raise LoraRequestError(
                    404, "lora_path", "lora_path_not_found", f"lora_path {path!r}: no such directory"
                )
            try:
                adapter = load_peft_adapter(name, path, self.max_lora_rank, self.manager.targets)
                self.manager.check(adapter)
            except LoraLoadError as exc:
                raise LoraRequestError(400, "lora_path", "invalid_lora_adapter", str(exc)) from None
            with self.lock:
                if name in self.paths and self.in_use(name):
                    raise LoraRequestError(
                        409, "lora_name", "lora_adapter_in_use", f"{self._in_use_message(name)}; retry when idle"
                    )
                self.manager.add(adapter)
                self.paths[name] = path
                return dict(self.paths)
        finally:
            with self.lock:
                self._loading.discard(name)

    def unload(self, name: str) -> dict[str, str]:
        if not isinstance(name, str) or not name:
            raise LoraRequestError(400, "lora_name", "invalid_value", "lora_name must be a non-empty string")
        with self.lock:
            if name not in self.paths:
                raise LoraRequestError(
                    404, "lora_name", "lora_adapter_not_found", f"The lora adapter '{name}' cannot be found."
                )
            del self.paths[name]
            if self.in_use(name):
                self._unloading.add(name)
            else:
                self.manager.remove(name)
            return dict(self.paths)

    def reap(self) -> None:
        """Drop the weights of unloaded adapters whose last request has finished (the core calls this after
        requests finish; cheap when nothing is being unloaded)."""
        if not self._unloading:
            return
        with self.lock:
            for name in [n for n in self._unloading if not self.in_use(n)]:
                self._unloading.discard(name)
                if name not in self.paths:  # not loaded again meanwhile
                    self.manager.remove(name)

    def _check_can_load(self, name: str, load_inplace: bool) -> None:
        if name in self._loading:
            raise LoraRequestError(409, "lora_name", "lora_adapter_loading", f"adapter {name!r} is already loading")
        if name in self._unloading:
            raise LoraRequestError(
                409, "lora_name", "lora_adapter_in_use", f"{self._in_use_message(name)} (unloaded); retry when idle"
            )
        if name in self.paths:
            if not load_inplace:
                raise LoraRequestError(
                    400,
                    "lora_name",
                    "lora_adapter_exists",
                    f"The lora adapter '{name}' has already been loaded (unload it first, or load_inplace: true).",
                )
            return
        capacity = self.manager.max_cpu_loras
        if len(self.paths) + len(self._loading) + len(self._unloading) >= capacity:
            raise LoraRequestError(
                400,
                "lora_name",
                "too_many_lora_adapters",
                f"{capacity} adapters are loaded, the --max-cpu-loras limit: unload one first",
            )

    def _in_use_message(self, name: str) -> str:
        return f"adapter {name!r} is still used by {self.in_use(name)} request(s)"
