"""A small executor for the inline PTX in `kernels.ballot` and `kernels.order`, for CPU tests.

It runs one warp: 32 lanes in lockstep (the only way `vote.sync` and `shfl.sync` can run), registers as numpy vectors over the lanes, predicated instructions,
warp-uniform branches (a divergent branch fails the test: the asm never diverges), a `.shared`
buffer the asm declares and a global memory of named arrays. Only the instructions the asm
uses are known; anything else fails loudly, as does a load or store outside every buffer, or
two lanes storing to one address in one instruction (the hardware would keep one of them).
"""

from __future__ import annotations

import re

import numpy as np

LANES = 32
_M32 = 0xFFFFFFFF
_SHARED_BASE = 0x1000  # the .shared symbol's address
_LANE = np.arange(LANES, dtype=np.uint64)


class Memory:
    """Global memory: uint32 arrays at distinct fake addresses (word addressed)."""

    def __init__(self) -> None:
        self._bufs: list[tuple[int, np.ndarray]] = []
        self._next = 1 << 32

    def add(self, words: np.ndarray) -> int:
        """Place a copy of `words` (any 32-bit dtype); returns its address."""
        base = self._next
        self._bufs.append((base, np.ascontiguousarray(words).view(np.uint32).ravel().copy()))
        self._next += (len(words.ravel()) * 4 + 4096) // 4096 * 4096 + (1 << 20)
        return base

    def array(self, base: int) -> np.ndarray:
        return next(buf for b, buf in self._bufs if b == base)

    def locate(self, addr: int) -> tuple[np.ndarray, int]:
        for base, buf in self._bufs:
            if base <= addr < base + 4 * len(buf):
                assert (addr - base) % 4 == 0, f"unaligned global access at {addr:#x}"
                return buf, (addr - base) // 4
        raise AssertionError(f"global access at {addr:#x} outside every buffer")


def _split_operands(text: str) -> list[str]:
    """Comma-separated operands, keeping {a, b} vectors and [addr+off] whole."""
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
    out.append(cur.strip())
    return out


class Warp:
    """Run `asm` (an inline-asm body: "{ ... }") for one warp.

    `operands[i]` is operand $i for every lane: a [32] array for inputs (addresses included),
    None for outputs, which `run` returns as [32] uint32 arrays.
    """

    def __init__(self, asm: str, memory: Memory | None = None) -> None:
        lines = [ln.strip() for ln in asm.split("\n") if ln.strip()]
        assert lines[0] == "{" and lines[-1] == "}", "an inline-asm body is one { } block"
        self.code: list[str] = []
        self.labels: dict[str, int] = {}
        self.shared_name, shared_bytes = None, 0
        for ln in lines[1:-1]:
            if ln.startswith(".reg"):
                continue
            m = re.fullmatch(r"\.shared \.align \d+ \.b8 (\w+)\[(\d+)\];", ln)
            if m:
                self.shared_name, shared_bytes = m.group(1), int(m.group(2))
                continue
            if re.fullmatch(r"\w+:", ln):
                self.labels[ln[:-1]] = len(self.code)
                continue
            assert ln.endswith(";"), ln
            self.code.append(ln[:-1])
        self.shared = np.zeros(shared_bytes // 4, dtype=np.uint32)
        self.memory = memory or Memory()
        self.executed = 0

    # --------------------------------------------------------------------- operands
    def _val(self, tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok.startswith("$"):
            v = self.ops[int(tok[1:])]
            assert v is not None, f"reads output operand {tok}"
            return np.asarray(v, dtype=np.uint64)
        if tok.startswith("%"):
            specials = {
                "%laneid": _LANE,
                "%lanemask_lt": (np.uint64(1) << _LANE) - np.uint64(1),
                "%lanemask_gt": (~((np.uint64(2) << _LANE) - np.uint64(1))) & np.uint64(_M32),
            }
            if tok in specials:
                return specials[tok]
            assert tok in self.regs, f"register {tok} read before it is written"
            return self.regs[tok]
        if tok == self.shared_name:
            return np.full(LANES, _SHARED_BASE, dtype=np.uint64)
        v = int(tok, 16) if tok.lower().startswith("0x") else int(tok)
        return np.full(LANES, v & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)

    def _put(self, tok: str, v: np.ndarray, active: np.ndarray, bits: int = 32) -> None:
        v = np.asarray(v, dtype=np.uint64) & np.uint64((1 << bits) - 1)
        if tok.startswith("$"):
            i = int(tok[1:])
            assert self.ops[i] is None or i in self.outs, f"writes input operand {tok}"
            self.outs.add(i)
            cur = self.ops[i] if self.ops[i] is not None else np.zeros(LANES, np.uint64)
            self.ops[i] = np.where(active, v, cur)
            return
        cur = self.regs.get(tok, np.zeros(LANES, dtype=np.uint64))
        self.regs[tok] = np.where(active, v, cur)

    def _addr(self, tok: str) -> np.ndarray:
        m = re.fullmatch(r"\[([%$\w]+)(?:\+(\d+))?\]", tok)
        assert m, tok
        return self._val(m.group(1)) + np.uint64(int(m.group(2) or 0))

    # --------------------------------------------------------------------- memory
    def _load(self, space: str, addr: int) -> int:
        if space == "shared":
            off = addr - _SHARED_BASE
            assert 0 <= off < 4 * len(self.shared) and off % 4 == 0, f"shared load at {off}"
            return int(self.shared[off // 4])
        buf, i = self.memory.locate(addr)
        return int(buf[i])

    def _store(self, space: str, addr: int, v: int) -> None:
        if space == "shared":
            off = addr - _SHARED_BASE
            assert 0 <= off < 4 * len(self.shared) and off % 4 == 0, f"shared store at {off}"
            self.shared[off // 4] = v & _M32
            return
        buf, i = self.memory.locate(addr)
        buf[i] = v & _M32

    def _memory_op(self, op: str, args: list[str], active: np.ndarray) -> None:
        space = "shared" if ".shared" in op else "global"
        width = 4 if ".v4" in op else 1
        lanes = np.flatnonzero(active)
        if op.startswith("ld."):
            dst = [t.strip() for t in args[0].strip("{}").split(",")]
            assert len(dst) == width
            addr = self._addr(args[1])
            for j, reg in enumerate(dst):
                vals = np.zeros(LANES, dtype=np.uint64)
                for lane in lanes:
                    vals[lane] = self._load(space, int(addr[lane]) + 4 * j)
                self._put(reg, vals, active)
            return
        addr = self._addr(args[0])
        if op.startswith("red."):
            assert op == "red.shared.add.u32", op
            inc = self._val(args[1])
            for lane in lanes:
                a = int(addr[lane])
                self._store(space, a, self._load(space, a) + int(inc[lane]))
            return
        src = [t.strip() for t in args[1].strip("{}").split(",")]
        assert len(src) == width
        written: set[int] = set()
        for j, tok in enumerate(src):
            vals = self._val(tok)
            for lane in lanes:
                a = int(addr[lane]) + 4 * j
                assert a not in written, f"two lanes store to {a:#x} in one {op}"
                written.add(a)
                self._store(space, a, int(vals[lane]))

    # --------------------------------------------------------------------- run
    def run(self, operands: list, max_steps: int = 100_000) -> list[np.ndarray]:
        self.ops = [None if o is None else np.asarray(o, dtype=np.uint64) for o in operands]
        self.outs: set[int] = set()
        self.regs: dict[str, np.ndarray] = {}
        pc = 0
        while pc < len(self.code):
            self.executed += 1
            assert self.executed < max_steps, "runaway asm"
            ln = self.code[pc]
            pc += 1
            active = np.ones(LANES, dtype=bool)
            m = re.fullmatch(r"@(!?)(%\w+) (.*)", ln)
            if m:
                p = self.regs[m.group(2)].astype(bool)
                active = ~p if m.group(1) else p
                ln = m.group(3)
            op, _, rest = ln.partition(" ")
            args = _split_operands(rest) if rest else []
            if op == "bra":
                assert active.all() or not active.any(), f"divergent branch at {ln!r}"
                if active.all():
                    pc = self.labels[args[0]]
                continue
            self._exec(op, args, active)
        return [self.ops[i].astype(np.uint32) for i in sorted(self.outs)]

    def _exec(self, op: str, args: list[str], active: np.ndarray) -> None:
        v = self._val
        m32 = np.uint64(_M32)
        if op in ("bar.warp.sync",):
            assert active.all(), "bar.warp.sync with inactive lanes"
            return
        if op.startswith(("ld.", "st.", "red.")):
            self._memory_op(op, args, active)
            return
        if op in ("mov.u32", "mov.b32"):
            self._put(args[0], v(args[1]), active)
        elif op in ("add.u32",):
            self._put(args[0], v(args[1]) + v(args[2]), active)
        elif op == "add.u64":
            self._put(args[0], v(args[1]) + v(args[2]), active, bits=64)
        elif op == "sub.u32":
            self._put(args[0], v(args[1]) + (m32 + np.uint64(1) - v(args[2])), active)
        elif op == "mul.wide.u32":
            self._put(args[0], v(args[1]) * v(args[2]), active, bits=64)
        elif op == "shl.b32":
            self._put(args[0], v(args[1]) << v(args[2]), active)
        elif op in ("and.b32", "xor.b32"):
            f = np.bitwise_and if op == "and.b32" else np.bitwise_xor
            self._put(args[0], f(v(args[1]), v(args[2])), active)
        elif op == "not.b32":
            self._put(args[0], ~v(args[1]) & m32, active)
        elif op in ("bfe.u32", "bfe.s32"):
            pos, length = v(args[2]), v(args[3])
            field = (v(args[1]) >> pos) & ((np.uint64(1) << length) - np.uint64(1))
            if op == "bfe.s32":
                sign = (field >> (length - np.uint64(1))) & np.uint64(1)
                field = np.where(sign == 1, field | (m32 ^ ((np.uint64(1) << length) - 1)), field)
            self._put(args[0], field, active)
        elif op == "popc.b32":
            self._put(args[0], np.array([bin(int(x)).count("1") for x in v(args[1])]), active)
        elif op == "max.u32":
            self._put(args[0], np.maximum(v(args[1]), v(args[2])), active)
        elif op == "redux.sync.max.u32":
            assert active.all() and int(v(args[2])[0]) == _M32
            self._put(args[0], np.full(LANES, v(args[1]).max()), active)
        elif op.startswith("setp."):
            _, cmp, _ = op.split(".")
            a, b = v(args[1]), v(args[2])
            res = {"eq": a == b, "ne": a != b, "lt": a < b, "ge": a >= b}[cmp]
            self._put(args[0], res, active)
        elif op == "selp.b32":
            self._put(args[0], np.where(v(args[3]) != 0, v(args[1]), v(args[2])), active)
        elif op == "vote.sync.ballot.b32":
            assert active.all() and int(v(args[2])[0]) == _M32
            mask = int(sum(1 << lane for lane in range(LANES) if v(args[1])[lane]))
            self._put(args[0], np.full(LANES, mask), active)
        elif op == "shfl.sync.up.b32":
            assert active.all() and int(v(args[4])[0]) == _M32 and int(v(args[3])[0]) == 0
            dst, pred = args[0].split("|")
            x, delta = v(args[1]), int(v(args[2])[0])
            src = _LANE.astype(np.int64) - delta
            ok = src >= 0
            self._put(dst, np.where(ok, x[np.clip(src, 0, None)], x), active)
            self._put(pred, ok, active)
        else:
            raise AssertionError(f"unknown instruction {op} {args}")
