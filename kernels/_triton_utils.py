"""Launch helpers shared by the Triton kernels.

``triton.jit`` decides between the compiler and the CPU interpreter when the decorator runs, i.e. when the
module is imported (triton 3.x reads ``TRITON_INTERPRET`` at decoration time). A test that sets the variable
after something else already imported ``kvserve.kernels`` would then launch compiled kernels on CPU
tensors. :class:`LazyKernel` keeps the plain Python function and picks the interpreter or the compiler at
*launch* time instead, so the env var only has to be set before the first launch.
"""

from __future__ import annotations

import os

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
            return self._interp[grid]
        if self._jit is None:
            from triton.runtime.jit import JITFunction

            self._jit = JITFunction(self.fn)
        return self._jit[grid]


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
