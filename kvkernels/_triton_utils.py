"""Launch helpers shared by the Triton kernels.

``triton.jit`` decides between the compiler and the CPU interpreter when the decorator runs, i.e. when the
module is imported (triton 3.x reads ``TRITON_INTERPRET`` at decoration time). A test that sets the variable
after something else already imported ``kvserve.kernels`` would then launch compiled kernels on CPU
tensors. :class:`LazyKernel` keeps the plain Python function and picks the interpreter or the compiler at
*launch* time instead, so the env var only has to be set before the first launch.

The same import-time decision also applies to triton's own ``@jit`` library functions (``tl.zeros``,
``tl.max``, ``tl.sum``, ``tl.cdiv`` ...): imported without ``TRITON_INTERPRET`` they are compiled-mode
``JITFunction`` objects, which the interpreter refuses to call ("Cannot call @triton.jit'd outside of the
scope of a kernel"). In a test process something usually imports triton early (a transformers forward
does), so for an interpreted launch we swap those objects in the ``triton.language`` namespaces for
``InterpretedFunction`` wrappers of the same source -- what ``triton.jit`` itself returns in interpreter
mode -- and restore them afterwards. CPU-test-only machinery; compiled launches never touch it.
"""

from __future__ import annotations

import contextlib
import os
import threading

import triton


def interpret_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` asks for the CPU interpreter (read on every call)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


class LazyKernel:
    """A Triton kernel function whose JIT/interpreter wrapper is chosen at launch.

    Usage mirrors ``@triton.jit``: ``kernel[grid](*args, CONST=...)``.
    """

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._jit = None
        self._interp = None

    def __getitem__(self, grid):
        if interpret_enabled():
            if self._interp is None:
                from triton.runtime.interpreter import InterpretedFunction

                self._interp = InterpretedFunction(self.fn)
            launcher = self._interp[grid]

            def launch(*args, **kwargs):
                with _interpreted_stdlib():
                    return launcher(*args, **kwargs)

            return launch
        if self._jit is None:
            from triton.runtime.jit import JITFunction

            self._jit = JITFunction(self.fn)
        return self._jit[grid]


_INTERP_STDLIB: dict = {}
_STDLIB_LOCK = threading.RLock()


@contextlib.contextmanager
def _interpreted_stdlib():
    """Temporarily replace compiled-mode JITFunctions in triton.language namespaces (see module doc)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    with _STDLIB_LOCK:
        saved = []
        for mod in (tl, tl.core, tl.standard, tl.math):
            for name, obj in list(vars(mod).items()):
                if isinstance(obj, JITFunction):
                    wrapped = _INTERP_STDLIB.get(id(obj))
                    if wrapped is None:
                        wrapped = _INTERP_STDLIB[id(obj)] = (obj, InterpretedFunction(obj.fn))
                    saved.append((mod, name, obj))
                    setattr(mod, name, wrapped[1])
        try:
            yield
        finally:
            for mod, name, obj in saved:
                setattr(mod, name, obj)


def lazy_jit(fn) -> LazyKernel:
    return LazyKernel(fn)


def check_device(*tensors) -> bool:
    """Return True if the launch must use the interpreter; raise if CPU tensors would hit the compiler."""
    interp = interpret_enabled()
    if not interp:
        for t in tensors:
            if t is not None and not t.is_cuda:
                raise RuntimeError(
                    "Triton kernels need CUDA tensors; got a tensor on "
                    f"{t.device}. Set TRITON_INTERPRET=1 to run them on CPU under the Triton interpreter."
                )
    return interp


__all__ = ["LazyKernel", "lazy_jit", "interpret_enabled", "next_pow2", "check_device", "triton"]
