"""`triton` and `triton.language` when installed, else stand-ins so every kernel module imports.

The engine runs on a CPU without triton (the README's first command installs no extras): kernel
modules import their names from here, and a kernel launched without triton raises a clear error.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

    class _Absent:
        """Any attribute, call or subscript of a triton name: fine to define, an error to run."""

        def __init__(self, name: str = "triton"):
            self._name = name

        def __getattr__(self, attr: str) -> "_Absent":
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Absent(f"{self._name}.{attr}")

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:   # a decorator: keep the name
                return _Absent(getattr(args[0], "__name__", self._name))
            if self._name.endswith(("jit", "autotune", "heuristics")):
                return _Absent(self._name)                            # @triton.jit(...) form
            if self._name.endswith("constexpr"):
                return args[0] if args else None
            raise RuntimeError(f"{self._name} needs triton, which is not installed "
                               "(pip install 'specfire[kernels]' on a GPU machine)")

        def __getitem__(self, grid) -> "_Absent":
            return _Absent(f"{self._name}[grid]")

    triton = _Absent("triton")
    tl = _Absent("triton.language")

__all__ = ["HAVE_TRITON", "triton", "tl"]
