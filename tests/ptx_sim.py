"""A small PTX interpreter for the inline-asm blocks of `pallas_kernels/indexer/mosaic_select.py` (and the register-only
blocks of `mosaic_fp4.py`, `run_registers`), so their logic (not only their syntax, which ptxas checks) is tested on
a machine without a GPU.

    cta = Cta(threads=128, shared=Memory(), glob=Memory())
    cta.run(asm, operands=[...])        # the block's $i operands: ints (addresses, scalars)
    Cta(threads=256, bar_id=15)         # a block for both warpgroups of a kernel, over its own named barrier

What it models: the PTX subset those blocks use (32-bit integer arithmetic incl. `prmt` / `bfe`, predicates, shared /
global loads,
stores and atomics, `bar.sync`, `vote.sync.ballot`, `shfl.sync.down`, `match.any.sync`, `%tid.x`,
`%lanemask_lt`, branches; a thread-block cluster's `mapa` / `ld.shared::cluster` over the cluster's shared memories,
`Cta(cluster=[...], rank=r)`). Every thread runs on its own program counter; a thread that reaches a collective
(`bar.sync` of the CTA's threads, or a warp's vote / shuffle / match) waits until every participant reaches the
same instruction, then the collective completes for all of them. Threads run in a seeded random order between
those points, so an access the block forgot to order by a barrier shows up as a run-to-run difference. Memory is
sequentially consistent and word-addressed (4-byte words; 16-byte vectors as four words); a register read before
it is written holds seeded garbage (`Cta.uninitialized` names them), so a result that depends on one changes with
the seed; fences are no-ops, and
`cvta.to.global` keeps the address; a `mapa` address is (CTA rank << 24) | shared address. `Cta.longest` sums
each run's busiest thread's instruction count: how a block's passes split over more threads, not a time.

This is test scaffolding, not a GPU model: it says nothing about speed, and what it runs is the PTX text the kernel
embeds, so a logic error there fails here before it reaches the H200.
"""

from __future__ import annotations

import random
import re

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1


def _prmt(a, b, c):
    """prmt.b32 d, a, b, c (default mode): byte i of d = byte (c's nibble i & 7) of the 8 bytes {b, a} (a = bytes
    0-3); with the nibble's bit 3 set, that byte's sign (bit 7) replicated to all 8 bits."""
    pool = (a & MASK32) | ((b & MASK32) << 32)
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


class Memory:
    """Word-addressed memory: byte address (a multiple of 4) -> u32 word; unwritten words read as `fill`."""

    def __init__(self, fill=0xDEADBEEF):
        self.words = {}
        self.fill = fill

    def load(self, addr):
        if addr % 4:
            raise AssertionError(f"misaligned 32-bit access at {addr:#x}")
        return self.words.get(addr, self.fill)

    def store(self, addr, value):
        if addr % 4:
            raise AssertionError(f"misaligned 32-bit access at {addr:#x}")
        self.words[addr] = value & MASK32

    def write_array(self, addr, values):
        for i, v in enumerate(values):
            self.store(addr + 4 * i, int(v) & MASK32)

    def read_array(self, addr, n, signed=True):
        out = [self.load(addr + 4 * i) for i in range(n)]
        return [v - (1 << 32) if signed and v >= 1 << 31 else v for v in out]


def _int(tok):
    return int(tok, 16) if tok.lower().startswith(("0x", "-0x")) else int(tok)


def _split_operands(text):
    """'d, {a, b}, [x+4], p' -> ['d', '{a, b}', '[x+4]', 'p'] (commas inside braces / brackets kept)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse(asm: str, operands):
    """The block's statements as (guard, negated, opcode, operands) and its labels -> statement index. `$i` become
    the literal operands (ints)."""
    for i in reversed(range(len(operands))):
        asm = asm.replace(f"${i}", str(int(operands[i])))
    if "$" in asm:
        raise AssertionError("the block uses an operand that was not given: " + asm[asm.index("$"):][:20])
    prog, labels = [], {}
    for line in asm.split("\n"):
        line = line.split("//", 1)[0]
        for piece in line.split(";"):
            s = piece.strip()
            while s and s[0] in "{}":   # scope braces (an instruction never starts with one)
                s = s[1:].strip()
            if not s or s.startswith(".reg"):
                continue
            m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*):\s*(.*)$", s)
            if m:
                if m.group(1) in labels:
                    raise AssertionError(f"label {m.group(1)} defined twice in one block")
                labels[m.group(1)] = len(prog)
                s = m.group(2).strip()
                if not s:
                    continue
            guard, neg = None, False
            if s.startswith("@"):
                g, s = s.split(None, 1)
                guard, neg = (g[2:], True) if g.startswith("@!") else (g[1:], False)
            op, _, rest = s.partition(" ")
            prog.append((guard, neg, op, _split_operands(rest)))
    return prog, labels


class Thread:
    def __init__(self, tid):
        self.tid = tid
        self.regs = {}
        self.preds = {}
        self.pc = 0
        self.done = False
        self.steps = 0   # instructions this thread executed (predicated-off ones included)


class Cta:
    """One CTA of `threads` threads (warps of 32) running PTX blocks over `shared` (its own) and `glob` memory."""

    def __init__(self, threads=128, shared=None, glob=None, seed=0, cluster=None, rank=0, tid_base=0, bar_id=1):
        self.n = threads
        self.tid_base = tid_base   # %tid.x of the first thread (a second warpgroup's: 128)
        self.bar_id = bar_id       # the named barrier the blocks sync over all `threads` threads
        self.shared = shared if shared is not None else Memory()
        self.cluster = cluster if cluster is not None else [self.shared]   # the cluster's shared memories, by rank
        if self.cluster[rank] is not self.shared:
            raise AssertionError("cluster[rank] must be this CTA's shared memory")
        self.glob = glob if glob is not None else Memory()
        self.rng = random.Random(seed)
        self.uninitialized = set()   # registers some thread read before writing them (garbage on the GPU too)
        self.executed = 0            # instructions executed (predicated-off ones included), summed over threads
        self.collectives = 0         # barriers and warp collectives completed (a barrier counts once)
        self.longest = 0             # sum over the runs of the busiest thread's instructions (a proxy for time)

    # ---- operand access (each token decoded once: an immediate, a special register or a register name)
    _tokens: dict = {}

    @classmethod
    def _decode(cls, tok):
        kind = cls._tokens.get(tok)
        if kind is None:
            s = tok.strip()
            if s in ("%tid.x", "%lanemask_lt"):
                kind = ("special", s)
            elif re.match(r"^-?(0x[0-9a-fA-F]+|\d+)$", s):
                kind = ("imm", _int(s) & MASK64)
            else:
                kind = ("reg", s)
            cls._tokens[tok] = kind
        return kind

    def _val(self, t, tok):
        kind, x = self._decode(tok)
        if kind == "reg":
            v = t.regs.get(x)
            if v is None:   # what an unwritten register holds on the GPU: anything (seeded garbage here)
                self.uninitialized.add(x)
                v = t.regs[x] = self.rng.getrandbits(32)
            return v
        if kind == "imm":
            return x
        return t.tid if x == "%tid.x" else (1 << (t.tid % 32)) - 1

    def _pred(self, t, tok):
        neg = tok.startswith("!")
        name = tok[1:] if neg else tok
        if name not in t.preds:
            raise AssertionError(f"thread {t.tid}: predicate {name} read before it was set")
        return t.preds[name] != neg

    _addrs: dict = {}

    def _addr(self, t, tok):
        parts = self._addrs.get(tok)
        if parts is None:
            parts = self._addrs[tok] = tok.strip()[1:-1].split("+")
        total = 0
        for part in parts:
            total += self._val(t, part)
        return total & MASK64

    # ---- execution
    def run(self, asm, operands=(), max_steps=50_000_000):
        prog, labels = parse(asm, operands)
        threads = [Thread(self.tid_base + i) for i in range(self.n)]
        steps = 0
        while True:
            live = [t for t in threads if not t.done]
            if not live:
                self.longest += max((t.steps for t in threads), default=0)
                return
            order = live[:]
            self.rng.shuffle(order)
            progressed = False
            for t in order:   # each thread runs to its next collective (or its end)
                while not t.done:
                    if t.pc >= len(prog):
                        t.done = True
                        progressed = True
                        break
                    guard, neg, op, args = prog[t.pc]
                    self.executed += 1
                    t.steps += 1
                    if guard is not None and self._pred(t, guard) == neg:
                        t.pc += 1
                        progressed = True
                        continue
                    if op.startswith(("bar.sync", "vote.", "shfl.", "match.")):
                        break
                    self._step(t, op, args, labels)
                    progressed = True
                    steps += 1
                    if steps > max_steps:
                        raise AssertionError("step limit reached (an endless loop?)")
            progressed |= self._collectives(threads, prog)
            if not progressed:
                waits = sorted({(t.pc, prog[t.pc][2]) for t in threads if not t.done})
                raise AssertionError(f"deadlock: threads wait at {waits[:6]}")

    def _collectives(self, threads, prog):
        """Completes every collective whose participants all wait at it; returns whether one did."""
        done_any = False
        live = [t for t in threads if not t.done]
        # CTA barrier: every thread of the CTA at a bar.sync (a finished thread would deadlock the GPU)
        at_bar = [t for t in live if t.pc < len(prog) and prog[t.pc][2].startswith("bar.sync")]
        if at_bar and len(at_bar) == self.n:
            pcs = {t.pc for t in at_bar}
            if len(pcs) != 1:
                # different bar.sync statements: legal PTX (same barrier id), but the blocks here never do it
                raise AssertionError(f"threads meet at different bar.sync statements {sorted(pcs)}")
            args = prog[at_bar[0].pc][3]
            if [a.strip() for a in args] != [str(self.bar_id), str(self.n)]:
                raise AssertionError(f"bar.sync {args}: the blocks sync barrier {self.bar_id} over {self.n} threads")
            for t in at_bar:
                t.pc += 1
            self.collectives += 1
            done_any = True
        for w in range(self.n // 32):
            lanes = threads[32 * w:32 * w + 32]
            if any(t.done or t.pc >= len(prog) for t in lanes):
                continue
            pcs = {t.pc for t in lanes}
            if len(pcs) != 1:
                continue
            _, _, op, args = prog[lanes[0].pc]
            if not op.startswith(("vote.", "shfl.", "match.")):
                continue
            if args[-1].strip() not in ("0xffffffff", "0xFFFFFFFF"):
                raise AssertionError(f"{op}: the blocks use full-warp masks, got {args[-1]}")
            if op.startswith("vote.sync.ballot"):
                bits = sum(1 << i for i, t in enumerate(lanes) if self._pred(t, args[1]))
                for t in lanes:
                    t.regs[args[0]] = bits
            elif op.startswith("shfl.sync.down"):
                vals = [self._val(t, args[1]) & MASK32 for t in lanes]
                d, clamp = self._val(lanes[0], args[2]), self._val(lanes[0], args[3])
                for i, t in enumerate(lanes):
                    src = i + d
                    t.regs[args[0]] = vals[src] if src <= clamp else vals[i]
            elif op.startswith("match.any.sync"):
                vals = [self._val(t, args[1]) & MASK32 for t in lanes]
                for i, t in enumerate(lanes):
                    t.regs[args[0]] = sum(1 << j for j, v in enumerate(vals) if v == vals[i])
            else:
                raise AssertionError(f"unmodelled collective {op}")
            for t in lanes:
                t.pc += 1
            self.collectives += 1
            done_any = True
        return done_any

    def _step(self, t, op, a, labels):
        fn = self._ops.get(op)
        if fn is None:
            fn = self._ops[op] = self._compile(op)
        t.pc += 1
        fn(self, t, a, labels)

    _ops: dict = {}

    @staticmethod
    def _compile(op):
        """The semantics of one opcode as a function (self, thread, operands, labels), built once per opcode."""
        def s32(x):
            x &= MASK32
            return x - (1 << 32) if x & (1 << 31) else x

        def alu(f, bits=32):
            mask = MASK32 if bits == 32 else MASK64

            def run(self, t, a, labels):
                t.regs[a[0]] = f(*[self._val(t, x) for x in a[1:]]) & mask
            return run

        base, parts = op.split(".")[0], op.split(".")
        table = {
            "add.u32": (lambda x, y: x + y), "add.s32": (lambda x, y: x + y), "sub.u32": (lambda x, y: x - y),
            "sub.s32": (lambda x, y: x - y), "mul.lo.u32": (lambda x, y: x * y),
            "mad.lo.u32": (lambda x, y, z: x * y + z), "and.b32": (lambda x, y: x & y),
            "or.b32": (lambda x, y: x | y), "xor.b32": (lambda x, y: x ^ y),
            "shl.b32": (lambda x, y: x << min(y, 32)), "shr.b32": (lambda x, y: (x & MASK32) >> min(y, 32)),
            "shr.u32": (lambda x, y: (x & MASK32) >> min(y, 32)), "max.s32": (lambda x, y: max(s32(x), s32(y))),
            "min.s32": (lambda x, y: min(s32(x), s32(y))), "popc.b32": (lambda x: bin(x & MASK32).count("1")),
            "max.u32": (lambda x, y: max(x & MASK32, y & MASK32)),
            "bfe.u32": (lambda x, pos, n: ((x & MASK32) >> pos) & ((1 << n) - 1) if pos < 32 else 0),
            "prmt.b32": _prmt,
        }
        if op in table:
            return alu(table[op])
        if op in ("add.u64",):
            return alu(lambda x, y: x + y, 64)
        if op == "mul.wide.u32":
            return alu(lambda x, y: (x & MASK32) * (y & MASK32), 64)
        if op == "cvta.to.global.u64":
            return alu(lambda x: x, 64)
        if op == "mapa.shared::cluster.u32":
            def run(self, t, a, labels):
                addr, rank = self._val(t, a[1]) & MASK32, self._val(t, a[2])
                if addr >= 1 << 24 or rank >= len(self.cluster):
                    raise AssertionError(f"mapa of {addr:#x} in CTA {rank}: outside the modelled cluster")
                t.regs[a[0]] = (rank << 24) | addr
            return run
        if op == "ld.shared::cluster.u32":
            def run(self, t, a, labels):
                ra = self._addr(t, a[1])
                t.regs[a[0]] = self.cluster[ra >> 24].load(ra & 0xFFFFFF)
            return run
        if base == "mov":
            return alu(lambda x: x, 64 if op.endswith("64") else 32)
        if op in ("bra", "bra.uni"):
            def run(self, t, a, labels):
                t.pc = labels[a[0]]
            return run
        if op in ("selp.b32", "selp.u32"):
            def run(self, t, a, labels):
                t.regs[a[0]] = (self._val(t, a[1]) if self._pred(t, a[3]) else self._val(t, a[2])) & MASK32
            return run
        if base == "setp":
            cmp_ = {"eq": lambda x, y: x == y, "ne": lambda x, y: x != y, "lt": lambda x, y: x < y,
                    "le": lambda x, y: x <= y, "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y}[parts[1]]
            conv = s32 if parts[-1] == "s32" else (lambda x: x & MASK32)
            with_and = "and" in parts[2:-1]

            def run(self, t, a, labels):
                r = cmp_(conv(self._val(t, a[1])), conv(self._val(t, a[2])))
                t.preds[a[0]] = (r and self._pred(t, a[3])) if with_and else r
            return run
        if op in ("and.pred", "or.pred"):
            both = op == "and.pred"

            def run(self, t, a, labels):
                x, y = self._pred(t, a[1]), self._pred(t, a[2])
                t.preds[a[0]] = (x and y) if both else (x or y)
            return run
        if base in ("ld", "st"):
            vec, glob = ".v4" in op, ".global" in op

            def run(self, t, a, labels):
                mem = self.glob if glob else self.shared
                addr = self._addr(t, a[1] if base == "ld" else a[0])
                if vec and addr % 16:
                    raise AssertionError(f"misaligned vector access at {addr:#x}")
                regs = a[0] if base == "ld" else a[1]
                names = [r.strip() for r in regs.strip("{}").split(",")] if vec else [regs]
                for i, r in enumerate(names):
                    if base == "ld":
                        t.regs[r] = mem.load(addr + 4 * i)
                    else:
                        mem.store(addr + 4 * i, self._val(t, r))
            return run
        if op == "red.shared.add.u32":
            def run(self, t, a, labels):
                addr = self._addr(t, a[0])
                self.shared.store(addr, self.shared.load(addr) + self._val(t, a[1]))
            return run
        if op in ("atom.global.add.u32", "atom.shared.add.u32"):
            glob = ".global" in op

            def run(self, t, a, labels):
                mem = self.glob if glob else self.shared
                addr = self._addr(t, a[1])
                old = mem.load(addr)
                mem.store(addr, old + self._val(t, a[2]))
                t.regs[a[0]] = old
            return run
        if base == "fence":
            return lambda self, t, a, labels: None

        def unmodelled(self, t, a, labels):
            raise AssertionError(f"unmodelled instruction {op} {a}")
        return unmodelled


def run_registers(asm: str, inputs, n_outputs: int):
    """Runs a register-only inline-asm block (outputs $0 .. $(n_outputs - 1), then the inputs, as LLVM numbers
    them) in one thread: the int inputs in, the outputs' u32 values out (stored to global memory after the block)."""
    for i in reversed(range(n_outputs)):
        asm = asm.replace(f"${i}", f"%sim_out{i}")
    for i in reversed(range(len(inputs))):
        asm = asm.replace(f"${n_outputs + i}", str(int(inputs[i]) & MASK32))
    stores = "".join(f"st.global.u32 [{4 * i}], %sim_out{i};\n" for i in range(n_outputs))
    glob = Memory()
    Cta(threads=1, glob=glob).run(asm + "\n" + stores)
    return [glob.load(4 * i) & MASK32 for i in range(n_outputs)]
