"""Compile a Triton kernel for Hopper (sm_90) without a GPU and report its resource usage.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` lowers a kernel to PTX and
a cubin with the ptxas bundled in the Triton wheel; no driver is needed (:ref:`ref-kernels-cpu`).
``CompiledKernel.n_regs``/``n_spills`` are only filled in when the kernel is loaded on a device,
so the registers and spills are read from ``ptxas -v`` on the generated PTX instead.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HopperReport", "compile_for_hopper", "in_compile_process"]


@dataclass(frozen=True)
class HopperReport:
    """Result of compiling one kernel specialization for sm_90.

    Attributes
    ----------
    name : str
        Kernel name.
    n_regs : int
        Registers per thread (``ptxas -v``).
    spill_stores, spill_loads : int
        Bytes of register spill stores and loads (0 when nothing spills).
    stack : int
        Stack frame bytes per thread.
    shared : int
        Static shared memory bytes (Triton's layout conversions).
    ptx : str
        The generated PTX (for checking instructions such as ``div.rn.f64`` or ``bar.sync``).
    """

    name: str
    n_regs: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int
    ptx: str

    def summary(self) -> str:
        """One line: name, registers, spills, stack, shared memory."""
        return (f"{self.name}: {self.n_regs} registers, {self.spill_stores} B spill stores, "
                f"{self.spill_loads} B spill loads, {self.stack} B stack, {self.shared} B shared")


def _ptxas_usage(ptx: str, arch: int) -> dict[str, int]:
    """Run the bundled ptxas with ``-v`` on ``ptx`` and parse its resource line."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([ptxas, f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}", "-v",
                              str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True)
    log = res.stdout + res.stderr

    def grab(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {"n_regs": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"), "stack": grab(r"(\d+) bytes stack frame")}


def compile_for_hopper(fn, signature: dict, constexprs: dict, num_warps: int = 4, **options) -> HopperReport:
    """Compile ``fn`` for sm_90 and report registers and spills.

    Parameters
    ----------
    fn : triton.JITFunction
        The kernel (must be a compiled JITFunction, i.e. not created under ``TRITON_INTERPRET=1``).
    signature : dict of str -> str
        Every argument's Triton type (``"*fp16"``, ``"i32"``, ``"fp32"``, ``"constexpr"``, ...).
    constexprs : dict of str -> value
        Values of the ``tl.constexpr`` arguments.
    num_warps : int
    **options
        Further compile options (e.g. ``enable_fp_fusion=False``).

    Returns
    -------
    HopperReport

    Raises
    ------
    TypeError
        ``fn`` is an interpreter function (made under ``TRITON_INTERPRET=1``; import a private copy
        of its module with ``triton.knobs.runtime.interpret = False``, as
        ``gpu.triton.quantize.hopper_compile`` does).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise TypeError(f"compile_for_hopper needs a triton.JITFunction, got {type(fn).__name__}")
    import triton.compiler.code_generator  # noqa: F401  (imported in the caller's interpreter mode)

    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    with triton.knobs.runtime.scope():  # code generation must not see TRITON_INTERPRET=1
        triton.knobs.runtime.interpret = False
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, **options})
    ptx = compiled.asm["ptx"]
    usage = _ptxas_usage(ptx, 90)
    return HopperReport(name=fn.__name__, shared=int(compiled.metadata.shared), ptx=ptx, **usage)


def in_compile_process(module: str, func: str, *args):
    """``module.func(*args)`` in a fresh Python process with ``TRITON_INTERPRET=0``.

    Under ``TRITON_INTERPRET=1`` a module's kernels are interpreter functions, and running them
    patches ``triton.language`` for the rest of the process, so kernels cannot be compiled there.
    Arguments and the result travel pickled through stdin/stdout.

    Raises
    ------
    RuntimeError
        The child failed (its stderr tail is in the message).
    """
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    code = (f"import pickle, sys; from {module} import {func} as f; "
            "sys.stdout.buffer.write(pickle.dumps(f(*pickle.loads(sys.stdin.buffer.read()))))")
    res = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(args), capture_output=True,
                         env=env, cwd=root)
    if res.returncode:
        raise RuntimeError(f"{module}.{func} failed in the compile process:\n"
                           f"{res.stderr.decode(errors='replace')[-4000:]}")
    return pickle.loads(res.stdout)
