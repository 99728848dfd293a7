"""A tiny emulator of the integer PTX our inline-asm blocks use (mov, and, or, shl, shr, prmt on .b32 / .u32
registers), so their bit logic is checked on a machine without a GPU: `run(asm, inputs, n_out)` -> outputs.

Registers are Python ints masked to 32 bits; `$i` are the block's operands (outputs first, then inputs, as in
`elementwise_inline_asm`); `.reg` declarations and braces are skipped. prmt is the default mode: each of the selector's
4 low nibbles picks a byte of {b, a} (bits 0-2) and, with bit 3 set, replicates that byte's sign bit."""

from __future__ import annotations

import re

MASK = 0xFFFFFFFF


def prmt(a: int, b: int, c: int) -> int:
    src = (a & MASK) | ((b & MASK) << 32)
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


OPS = {
    "mov": lambda a: a,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
    "shl": lambda a, b: (a << b) & MASK if b < 32 else 0,
    "shr": lambda a, b: a >> b if b < 32 else 0,     # .u32 / .b32: logical
    "prmt": prmt,
}


def run(asm: str, inputs, n_out: int):
    """Executes `asm` with $n_out.. = inputs (ints) -> [$0 .. $n_out-1]."""
    regs = {f"${n_out + i}": int(v) & MASK for i, v in enumerate(inputs)}

    def value(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return int(tok, 0) & MASK
        raise KeyError(f"unset register or bad operand {tok!r}")

    for line in asm.splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        m = re.fullmatch(r"(\w+)((?:\.\w+)*)\s+(.*)", line)
        if not m or m.group(1) not in OPS:
            raise NotImplementedError(f"ptx_emulator: {line!r}")
        if m.group(1) == "shr" and ".s32" in m.group(2):
            raise NotImplementedError("ptx_emulator: arithmetic shifts")
        dst, *srcs = [t.strip() for t in m.group(3).split(",")]
        regs[dst] = OPS[m.group(1)](*(value(s) for s in srcs)) & MASK
    return [regs[f"${i}"] for i in range(n_out)]
