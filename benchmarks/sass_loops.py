"""The loops of a kernel's SASS: instructions, static stall cycles and an opcode histogram per loop body.

    python benchmarks/sass_loops.py KERNEL.sass_ctrl [--min-instructions 20] [--top 12]

Reads nvdisasm's SASS with control codes (the `.sass_ctrl` that `benchmarks/mosaic_offline.py` leaves beside each
kernel where an nvdisasm is found). A loop is a backward branch: its body runs from the branch target to the branch.
Per loop this prints the instruction count, the sum of the control codes' stall fields (the cycles the warp waits
before issuing its next instruction, ignoring dependency barriers and memory: a lower bound on one warp's cycles
through the body when nothing else stalls it), and the most frequent opcodes. Nested loops are printed each on its
own; an outer body's counts include its inner loops' bodies once.

Why (session 50): no GPU this session; the fp4 conversion's cost per key block is an issue-rate question, and the
converter warpgroup's loop is the place to count it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re

# "   1:-:2:Y:05        /*00b0*/   @!P1 SHF.R.U32.HI R6, RZ, 0x5, R10 ;"  (wait mask : read : write : yield : stall)
_INSTR = re.compile(r"^\s*(\S+):(\S+):(\S+):(\S):(\d+)\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;?\s*$")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):\s*$")
_BRANCH = re.compile(r"\bBRA\s+(?:\.U\s+)?`?\((\.L_x_\d+)\)")


@dataclasses.dataclass
class Instruction:
    address: int
    stall: int
    text: str

    @property
    def opcode(self) -> str:
        body = re.sub(r"^@!?U?P\w+\s+", "", self.text)
        return body.split()[0] if body else ""


def parse(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """Instructions in address order, and each label's address (the next instruction's)."""
    instructions, labels, pending = [], {}, []
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            address = int(m.group(6), 16)
            for name in pending:
                labels[name] = address
            pending = []
            instructions.append(Instruction(address, int(m.group(5)), m.group(7)))
    return instructions, labels


@dataclasses.dataclass
class Loop:
    start: int
    end: int
    body: list[Instruction]

    @property
    def stall_cycles(self) -> int:
        return sum(i.stall for i in self.body)

    def histogram(self) -> collections.Counter:
        return collections.Counter(i.opcode for i in self.body)


def loops(instructions: list[Instruction], labels: dict[str, int]) -> list[Loop]:
    found = []
    for ins in instructions:
        m = _BRANCH.search(ins.text)
        if m and m.group(1) in labels and labels[m.group(1)] <= ins.address:
            start = labels[m.group(1)]
            body = [i for i in instructions if start <= i.address <= ins.address]
            found.append(Loop(start, ins.address, body))
    return sorted(found, key=lambda lp: (lp.start, -lp.end))


def block_loops(instructions: list[Instruction], labels: dict[str, int]) -> dict:
    """The Mosaic indexer kernel's per-block loops: "scores" = the smallest loop holding a wgmma (QGMMA/HGMMA: on
    the register path it converts too), "converter" = the smallest loop without one that converts (PRMT) and stores
    to shared memory (the fp4 converter warpgroup's); each as its Loop, or None where there is none."""
    found = loops(instructions, labels)

    def ops(lp):
        return set(lp.histogram())

    mma = [lp for lp in found if any(o.startswith(("QGMMA", "HGMMA")) for o in ops(lp))]
    conv = [lp for lp in found if lp not in mma and "PRMT" in ops(lp)
            and any(o.startswith("STS") for o in ops(lp))]
    smallest = lambda ls: min(ls, key=lambda lp: len(lp.body)) if ls else None
    return dict(scores=smallest(mma), converter=smallest(conv))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass")
    ap.add_argument("--min-instructions", type=int, default=20)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    instructions, labels = parse(open(a.sass).read())
    print(f"{a.sass}: {len(instructions)} instructions")
    for lp in loops(instructions, labels):
        if len(lp.body) < a.min_instructions:
            continue
        top = ", ".join(f"{op} {n}" for op, n in lp.histogram().most_common(a.top))
        print(f"  loop {lp.start:#06x}-{lp.end:#06x}: {len(lp.body)} instructions, {lp.stall_cycles} stall cycles; "
              f"{top}")


if __name__ == "__main__":
    main()
