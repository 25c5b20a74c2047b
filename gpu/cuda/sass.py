"""Static SASS analysis of decode-kernel loops (no GPU): what one loop iteration issues, by pipe.

``kernel_sass(cubin, name)`` disassembles one kernel (``nvdisasm``); ``main_loop`` picks the loop with
the most tensor-core instructions (the encoded-token loop) and ``fast_path`` the fewest instructions
one iteration can issue from the loop head to its backward branch (a shortest path through the
loop's control-flow graph: the path taken when no rescale, masking or other rare branch runs; for a
loop without branches, its whole body). ``count`` classifies instructions:

* ``alu``: the ALU-pipe opcodes (16 lanes, half rate on Hopper): LOP3, LOP, PRMT, SHF, FSEL, SEL,
  ISETP, FSETP, FMNMX, IMNMX, F2FP, IADD3, LEA, P2R, R2P, PLOP3 (the design review's list, from
  NVIDIA's statements on the GV100/GH100 pipes, plus their variants);
* ``fma``: IMAD, FFMA, FMUL, FADD, HFMA2, HMUL2, HADD2 and friends (FMA pipes);
* ``mma``: HMMA/IMMA/HGMMA; ``mufu``: MUFU; ``shfl``, ``vote``, ``movm``;
* memory: ``ldg`` by width in bytes, ``lds``/``sts`` (shared), ``ldl``/``stl`` (local), ``ldsm``/``stsm``.

Per token and KV head, a warp's loop iteration covers ``tokens_per_iteration`` tokens of one KV head
(16 U for the CUDA kernel; block_n / warps for the Triton one), so warp instructions per token-head =
count / tokens_per_iteration.
"""

from __future__ import annotations

import heapq
import re
import subprocess
import tempfile
from pathlib import Path

__all__ = ["ALU_OPS", "FMA_OPS", "kernel_sass", "kernel_names", "main_loop", "fast_path", "count", "opcode",
           "loads_in_flight"]

ALU_OPS = frozenset({"LOP3", "LOP", "PRMT", "SHF", "FSEL", "SEL", "ISETP", "FSETP", "FMNMX", "IMNMX", "F2FP", "IADD3",
                     "LEA", "P2R", "R2P", "PLOP3"})
FMA_OPS = frozenset({"IMAD", "FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2", "IMUL", "IADD", "FMNMX2"})
MMA_OPS = frozenset({"HMMA", "IMMA", "HGMMA", "IGMMA"})
_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def _nvdisasm() -> str:
    from gpu.triton.report import nvdisasm_path

    tool = nvdisasm_path()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the gpu extra) or a CUDA toolkit")
    return tool


def _disassemble(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.cubin"
        f.write_bytes(cubin)
        return subprocess.run([_nvdisasm(), "-c", str(f)], capture_output=True, text=True, check=True).stdout


def kernel_names(cubin: bytes) -> list[str]:
    """Mangled names of the kernels in a cubin."""
    return re.findall(r"^\.text\.(\S+):", _disassemble(cubin), flags=re.M)


def kernel_sass(cubin: bytes, name_contains: str) -> tuple[list[str], dict]:
    """(instructions, labels) of the one kernel whose mangled name contains ``name_contains``;
    labels map to the index of the instruction that follows them."""
    text = _disassemble(cubin)
    sections = re.split(r"^\.text\.(\S+):\s*$", text, flags=re.M)
    hits = [(sections[i], sections[i + 1]) for i in range(1, len(sections) - 1, 2) if name_contains in sections[i]]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} kernels match {name_contains!r}")
    lines, labels = [], {}
    for raw in hits[0][1].splitlines():
        lab = _LABEL.match(raw)
        if lab:
            labels[lab.group(1)] = len(lines)
            continue
        m = _LINE.match(raw)
        if m:
            lines.append(m.group(2).strip())
    return lines, labels


def opcode(ins: str) -> str:
    """The opcode without predicate and modifiers: ``@!P0 LOP3.LUT R1, ...`` -> ``LOP3``."""
    tok = ins.split()
    op = tok[1] if tok[0].startswith("@") else tok[0]
    return op.split(".")[0]


def _target(ins: str, labels: dict):
    m = re.search(r"\bBRA\b[^`]*`?\(?(\.L_x_\d+)\)?", ins)
    return labels.get(m.group(1)) if m else None


def main_loop(lines: list[str], labels: dict) -> tuple[int, int]:
    """(head, backedge) instruction indices of the loop holding the most MMA instructions."""
    best, best_mma = None, -1
    for i, ins in enumerate(lines):
        tgt = _target(ins, labels) if opcode(ins) == "BRA" else None
        if tgt is not None and tgt <= i:
            mma = sum(opcode(x) in MMA_OPS for x in lines[tgt:i + 1])
            if mma > best_mma:
                best, best_mma = (tgt, i), mma
    if best is None:
        raise ValueError("no loop in the kernel")
    return best


def fast_path(lines: list[str], labels: dict, head: int, back: int) -> list[str]:
    """Instructions on the shortest path from ``head`` to the backward branch at ``back`` (inclusive),
    staying inside [head, back]; nested backward branches are not followed."""
    dist, prev = {head: 1}, {head: None}
    heap = [(1, head)]
    while heap:
        dd, i = heapq.heappop(heap)
        if dd > dist.get(i, 1 << 30) or i == back:
            continue
        ins = lines[i]
        op = opcode(ins)
        pred = ins.startswith("@")
        succ = []
        if op == "BRA":
            tgt = _target(ins, labels)
            if tgt is not None and head <= tgt <= back and tgt > i:
                succ.append(tgt)
            if pred:
                succ.append(i + 1)
        elif op in ("EXIT", "RET") and not pred:
            pass
        else:
            succ.append(i + 1)
        for j in succ:
            if head <= j <= back and dd + 1 < dist.get(j, 1 << 30):
                dist[j], prev[j] = dd + 1, i
                heapq.heappush(heap, (dd + 1, j))
    if back not in dist:
        raise ValueError("the loop's backward branch is not reachable from its head")
    path, i = [], back
    while i is not None:
        path.append(lines[i])
        i = prev[i]
    return path[::-1]


_REG = re.compile(r"\bR(\d+)\b")


def loads_in_flight(lines: list[str]) -> int:
    """The most global loads (LDG) a listing issues before the first use of any of them, in program order.

    A load's destination is its first operand; an instruction uses it when the register appears among
    its other operands (all of them for stores). A use ends a run of outstanding loads; an instruction
    that writes a pending register without reading it retires that load silently. Straight-line code is
    what this measures (the merge kernel's unrolled batch); branches are read in listing order.
    """
    best = run = 0
    pending: set[int] = set()
    for ins in lines:
        body = ins.split(None, 1)[1] if ins.startswith("@") else ins
        parts = body.split(None, 1)
        op = parts[0].split(".")[0]
        operands = [x.strip() for x in parts[1].split(",")] if len(parts) > 1 else []
        regs = [[int(r) for r in _REG.findall(x)] for x in operands]
        store = op.startswith("ST") or op in ("RED", "ATOM")
        srcs = {r for x in (regs if store else regs[1:]) for r in x}
        if srcs & pending:
            best, run = max(best, run), 0
            pending.clear()
        if op == "LDG" and regs and regs[0]:
            pending.add(regs[0][0])
            run += 1
        elif not store and regs and regs[0]:
            pending.discard(regs[0][0])
    return max(best, run)


def _ldg_width(ins: str) -> int:
    op = ins.split()[1] if ins.startswith("@") else ins.split()[0]
    m = re.search(r"\.(128|64|U16|S16|U8|S8)\b", op)
    return {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}[m.group(1)] if m else 4


def count(instrs: list[str]) -> dict:
    """Instruction counts of a list by class (module docstring)."""
    out = {"total": len(instrs), "alu": 0, "fma": 0, "mma": 0, "mufu": 0, "shfl": 0, "vote": 0, "movm": 0,
           "fsel": 0, "lds": 0, "sts": 0, "ldsm": 0, "stsm": 0, "ldl": 0, "stl": 0, "ldg": {}, "other": 0}
    for ins in instrs:
        op = opcode(ins)
        if op in ALU_OPS:
            out["alu"] += 1
        elif op in FMA_OPS:
            out["fma"] += 1
        elif op in MMA_OPS:
            out["mma"] += 1
        elif op in ("LDG", "LDGSTS"):
            w = _ldg_width(ins)
            out["ldg"][w] = out["ldg"].get(w, 0) + 1
        else:
            key = {"MUFU": "mufu", "SHFL": "shfl", "VOTE": "vote", "MOVM": "movm", "LDS": "lds", "STS": "sts",
                   "LDSM": "ldsm", "STSM": "stsm", "LDL": "ldl", "STL": "stl"}.get(op)
            if key:
                out[key] += 1
            else:
                out["other"] += 1
        if op == "FSEL":
            out["fsel"] += 1
    return out
