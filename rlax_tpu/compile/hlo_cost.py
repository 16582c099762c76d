"""FLOPs and HBM bytes of a compiled program per call, loops counted as often as they run.

XLA's `cost_analysis()` counts the body of a while loop once, whatever its trip count, so
a train step (a scan over optimizer updates, each over micro-batches, each over layers with
`scan_layers`) would be undercounted many times over. This walks the optimized HLO text
instead (`compiled.as_text()`, per device after SPMD partitioning):

* trip counts: a loop runs while `i < N` on an element i of its state; N comes from the
  condition, i's start from the loop's initial tuple and its step from the body (JAX's
  scans count from 0 by 1, the partitioner's windowed matmuls by 2); else the trip count
  XLA's loop analysis recorded in the loop's backend config (XLA:CPU and XLA:GPU write
  their conditions as fusions). A loop of another form counts once and is reported in
  `unknown_loops`.
* FLOPs: 2 · |output| · contraction of every `dot` and `convolution` (the TPU compiler
  writes matmuls as convolutions whose windows mostly meet padding or dilation holes: only
  the taps that meet an input element count), XLA:GPU's cuBLAS matmul calls from their
  dimension numbers, and the `cost_estimate` that Mosaic kernels
  (`tpu_custom_call`) carry. Splash attention's kernels carry none: their matmuls are
  counted from their operand shapes over the causal half of the score blocks. Another
  kernel without one (the paged-attention decode kernel) counts 0 and its calls are
  reported in `kernels_without_cost`. Elementwise work (the VPU's) is not counted: the
  peak FLOP/s a roofline divides by is the matrix units'.
* bytes: each instruction outside fusions reads its operands and writes its result in HBM
  (arrays placed in VMEM/SMEM, layouts with memory space S(n), are skipped); an operand
  that a fusion only slices is read for the slices' bytes (a scan reading one layer of
  stacked weights), and a buffer updated in place (dynamic-update-slice, scatter: the KV
  cache) costs the update's bytes. Kernels with a cost estimate count its bytes; others
  their operands and results (the paged-attention kernel: the whole pool, the worst case).

An estimate from the compiler's own shapes; docs/trainer.md ("Compile for the real
topology") says how it compares with XLA's figures and with the analytic FLOPs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "s4": 0.5,
    "u4": 0.5,
    # float8 (inference.weight_dtype="fp8" serves float8_e4m3fn weights)
    "f8e4m3fn": 1,
    "f8e4m3": 1,
    "f8e5m2": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1,
}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%([^\s(]+) .*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = (.*)$", re.DOTALL)
# Instructions that move no data of their own (or whose data movement is counted elsewhere).
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "iota",
}
_SLICING = {"dynamic-slice", "slice", "gather"}
# Updates of a buffer in place: they read and write the update, not the buffer (operand 0).
_IN_PLACE = {"dynamic-update-slice", "scatter"}


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    memory_space: int  # 0: HBM; 1: VMEM, others: SMEM, sync flags...

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> float:
        return self.size * _DTYPE_BYTES.get(self.dtype, 0)

    @property
    def hbm_bytes(self) -> float:
        return self.bytes if self.memory_space == 0 else 0.0


def _arrays(shape: str) -> list[Array]:
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append(
            Array(
                dtype,
                tuple(int(d) for d in dims.split(",") if d),
                int(space.group(1)) if space else 0,
            )
        )
    return out


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # the result's shape text (an array or a tuple)
    opcode: str
    operands: list[str]
    args: str  # the text between the opcode's parentheses (a constant's value, a parameter's index)
    attrs: str

    @property
    def result(self) -> list[Array]:
        return _arrays(self.shape)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(%[^\s,]+|\{{[^}}]*\}}|\"[^\"]*\"|[^\s,]+)", self.attrs)
        return m.group(1) if m else None

    def called(self, key: str) -> list[str]:
        value = self.attr(key)
        return re.findall(r"%([^\s,{}]+)", value) if value else []


@dataclasses.dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: list[Instruction]

    def __post_init__(self) -> None:
        self.by_name = {i.name: i for i in self.instructions}
        self.users: dict[str, list[Instruction]] = {}
        for instr in self.instructions:
            for op in instr.operands:
                self.users.setdefault(op, []).append(instr)

    @property
    def root(self) -> Instruction:
        return self.instructions[-1]

    def parameter(self, index: int) -> Instruction | None:
        for instr in self.instructions:
            if instr.opcode == "parameter" and instr.args.strip() == str(index):
                return instr
        return None


def _split_balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start] (strings skipped)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    closing = set(pairs.values())
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return i + 1
        elif c == '"':  # a string (backend configs): skip to its unescaped end
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        i += 1
    return len(text)


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    if rest.startswith("("):
        end = _split_balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    end = _split_balanced(rest, paren)
    args = rest[paren + 1 : end - 1]
    operands = re.findall(r"%([^\s,()]+)", args)
    return Instruction(name, shape, opcode, operands, args, rest[end:].lstrip(", "))


def parse_module(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, in the order printed (callees first).

    An instruction may span lines (a kernel's metadata holds newlines): lines that start
    neither an instruction nor close the computation (a bare "}") continue the last one."""
    comps: dict[str, Computation] = {}
    current: tuple[str, bool, list[str]] | None = None

    def close(name: str, is_entry: bool, lines: list[str]) -> None:
        instrs = [i for i in map(_parse_instruction, lines) if i is not None]
        comps[name] = Computation(name, is_entry, instrs)

    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = (m.group(2), bool(m.group(1)), [])
            continue
        if line.rstrip() == "}":
            close(*current)
            current = None
        elif _INSTR.match(line) or not current[2]:
            current[2].append(line)
        else:
            current[2][-1] += "\n" + line
    return comps


@dataclasses.dataclass
class HloCost:
    """Per-device figures of one call of a compiled program."""

    flops: float
    bytes_accessed: float
    loops: list[tuple[str, int]]  # (while instruction, trip count), outermost first
    unknown_loops: int
    kernels_without_cost: int  # calls of Pallas kernels that carry no cost estimate
    splash_kernels: int = 0  # calls of splash attention kernels counted from their shapes

    def to_json(self) -> dict:
        return {
            "flops": self.flops,
            "bytes_accessed": self.bytes_accessed,
            "loops": [{"name": n, "trip_count": t} for n, t in self.loops],
            "unknown_loops": self.unknown_loops,
            "kernels_without_cost": self.kernels_without_cost,
            "splash_kernels": self.splash_kernels,
        }


def _source(comp: Computation, name: str) -> Instruction | None:
    """The instruction `name` stands for, through copies, bitcasts and converts."""
    instr = comp.by_name.get(name)
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert") and instr.operands:
        instr = comp.by_name.get(instr.operands[0])
    return instr


def _constant(instr: Instruction | None) -> int | None:
    if instr is None or instr.opcode != "constant" or not re.fullmatch(r"-?\d+", instr.args):
        return None
    return int(instr.args)


def _tuple_index(instr: Instruction | None) -> int | None:
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    m = re.search(r"\bindex=(\d+)", instr.attrs)
    return int(m.group(1)) if m else None


def trip_count(
    cond: Computation,
    body: Computation | None = None,
    init: Instruction | None = None,
    caller: Computation | None = None,
) -> int | None:
    """Iterations of a while loop whose condition is `i < N` on a tuple element i: N from
    the condition, i's start from the loop's initial tuple (`init` in `caller`; default 0)
    and its step from the body's root tuple (`i + c`; default 1). JAX's loops count from 0
    by 1; the SPMD partitioner's windowed matmul loops count by 2. None for another form."""
    root = cond.root
    if root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    index = _tuple_index(_source(cond, root.operands[0]))
    bound = _constant(_source(cond, root.operands[1]))
    if index is None or bound is None:
        return None
    start, step = 0, 1
    if init is not None and caller is not None:
        initial = _source(caller, init.operands[0]) if init.operands else None
        if initial is not None and initial.opcode == "tuple" and index < len(initial.operands):
            value = _constant(_source(caller, initial.operands[index]))
            start = value if value is not None else 0
    if body is not None and body.root.opcode == "tuple" and index < len(body.root.operands):
        update = _source(body, body.root.operands[index])
        if update is not None and update.opcode == "add" and len(update.operands) == 2:
            a, b = (_source(body, o) for o in update.operands)
            c = _constant(b) if _tuple_index(a) == index else _constant(a)
            step = c if c else 1
    return max(0, -(-(bound - start) // step))


def known_trip_count(instr: Instruction) -> int | None:
    """The trip count XLA's loop analysis recorded on a while instruction
    (`backend_config={..."known_trip_count":{"n":"7"}...}`), or None."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)
    return int(m.group(1)) if m else None


def _contraction_flops(instr: Instruction, comp: Computation) -> float:
    out = instr.result
    if not out or len(instr.operands) < 2:
        return 0.0
    lhs_i, rhs_i = (comp.by_name.get(o) for o in instr.operands[:2])
    if instr.opcode == "dot":
        lhs = lhs_i.result[0] if lhs_i is not None and lhs_i.result else None
        dims = instr.attr("lhs_contracting_dims")
        if lhs is None or dims is None:
            return 0.0
        k = math.prod(lhs.dims[int(d)] for d in re.findall(r"\d+", dims))
        return 2.0 * out[0].size * k
    # convolution: contraction = the kernel's input features × the window taps that meet
    # an input element (the TPU compiler writes batched matmuls as convolutions whose
    # windows mostly meet padding or dilation holes), averaged over the output positions.
    lhs = lhs_i.result[0] if lhs_i is not None and lhs_i.result else None
    rhs = rhs_i.result[0] if rhs_i is not None and rhs_i.result else None
    labels = instr.attr("dim_labels")
    if lhs is None or rhs is None or labels is None:
        return 0.0
    (lhs_labels, rhs_labels), out_labels = labels.split("->")[0].split("_"), labels.split("->")[1]
    sizes = {
        side: {c: n for c, n in zip(lab, arr.dims, strict=False) if c.isdigit()}
        for side, lab, arr in (
            ("lhs", lhs_labels, lhs),
            ("rhs", rhs_labels, rhs),
            ("out", out_labels, out[0]),
        )
    }
    window = _window(instr.attrs)
    k = math.prod(n for c, n in zip(rhs_labels, rhs.dims, strict=False) if c == "i")
    for dim in sorted(sizes["rhs"]):
        spec = window[int(dim)] if int(dim) < len(window) else {}
        k *= mean_taps(sizes["lhs"].get(dim, 1), sizes["out"].get(dim, 1), sizes["rhs"][dim], spec)
    return 2.0 * out[0].size * k


def _window(attrs: str) -> list[dict[str, int]]:
    """Per spatial dimension: size, stride, pad_lo, lhs_dilate, rhs_dilate."""
    m = re.search(r"\bwindow=\{([^}]*)\}", attrs)
    fields: dict[str, list[str]] = {}
    for item in m.group(1).split() if m else []:
        key, _, value = item.partition("=")
        fields[key] = value.split("x")
    n = len(fields.get("size", []))
    dims = []
    for d in range(n):
        pad = fields["pad"][d].split("_") if "pad" in fields else ["0", "0"]
        dims.append(
            {
                "size": int(fields["size"][d]),
                "stride": int(fields["stride"][d]) if "stride" in fields else 1,
                "pad_lo": int(pad[0]),
                "lhs_dilate": int(fields["lhs_dilate"][d]) if "lhs_dilate" in fields else 1,
                "rhs_dilate": int(fields["rhs_dilate"][d]) if "rhs_dilate" in fields else 1,
            }
        )
    return dims


def mean_taps(lhs: int, out: int, kernel: int, spec: dict[str, int]) -> float:
    """Window taps per output position that land on an input element (not padding, not a
    dilation hole), averaged over the `out` positions of one spatial dimension."""
    size = spec.get("size", kernel)
    stride, pad = spec.get("stride", 1), spec.get("pad_lo", 0)
    ld, rd = spec.get("lhs_dilate", 1), spec.get("rhs_dilate", 1)
    last = (lhs - 1) * ld  # the last input element's position in the dilated input
    valid = 0
    for t in range(size):
        offset = t * rd - pad  # input position of output o: o * stride + offset
        lo = max(0, -(-(0 - offset) // stride))
        hi = min(out - 1, (last - offset) // stride)
        if hi < lo:
            continue
        if ld == 1:
            valid += hi - lo + 1
        elif (hi - lo + 1) <= 4096:
            valid += sum(1 for o in range(lo, hi + 1) if (o * stride + offset) % ld == 0)
        else:
            valid += (hi - lo + 1) / ld
    return valid / out if out else 0.0


# Splash attention's kernels carry no cost estimate; their matmuls are counted from their
# operand shapes: q [..., s, d] (every query row), k [..., s_k, d], each an s × s_k score
# matmul over all rows, over the causal half of the blocks. Forward: scores and P·V; dq:
# scores, dP, dS·K; dkv: scores, dP, dV, dK.
_SPLASH = re.compile(r"splash_(mqa|mha)_(fwd|dq|dkv)")
_SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}
CAUSAL_FRACTION = 0.5


def _splash_flops(instr: Instruction) -> float | None:
    m = _SPLASH.match(instr.name)
    key = "operand_layout_constraints="
    start = instr.attrs.find(key)
    if not m or start < 0:
        return None
    text = instr.attrs[start + len(key) : _split_balanced(instr.attrs, start + len(key))]
    arrays = [a for a in _arrays(text) if len(a.dims) >= 3 and a.dtype in ("bf16", "f32")]
    if len(arrays) < 2:
        return None
    q, k = arrays[0], arrays[1]
    rows, d, keys = math.prod(q.dims[:-1]), q.dims[-1], k.dims[-2]
    return _SPLASH_MATMULS[m.group(2)] * 2.0 * rows * keys * d * CAUSAL_FRACTION


def _cublas_flops(instr: Instruction, comp: Computation) -> float | None:
    """2 · |output| · contraction of an XLA:GPU matmul custom call (`__cublas$gemm`,
    `__cublas$lt$matmul`): its dimension numbers are in the gemm backend config, its first
    result is the product (the second, cuBLAS's workspace)."""
    if "__cublas$" not in instr.attrs:
        return None
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs)
    lhs_i = comp.by_name.get(instr.operands[0]) if instr.operands else None
    if m is None or lhs_i is None or not lhs_i.result or not instr.result:
        return None
    lhs = lhs_i.result[0]
    k = math.prod(lhs.dims[int(d)] for d in re.findall(r"\d+", m.group(1)))
    return 2.0 * instr.result[0].size * k


def _cost_estimate(instr: Instruction) -> dict | None:
    m = re.search(r'"cost_estimate":(\{[^}]*\})', instr.attrs)
    if not m:
        return None
    try:
        return {k: float(v) for k, v in json.loads(m.group(1)).items()}
    except (ValueError, TypeError):
        return None


def _update_bytes(instr: Instruction, comp: Computation) -> float | None:
    """Bytes an in-place update writes (its update operand), or None for another op."""
    if instr.opcode not in _IN_PLACE or len(instr.operands) < 2:
        return None
    index = 1 if instr.opcode == "dynamic-update-slice" else len(instr.operands) - 1
    update = comp.by_name.get(instr.operands[index])
    return None if update is None else sum(a.bytes for a in update.result)


class _Walker:
    def __init__(self, comps: dict[str, Computation]) -> None:
        self.comps = comps
        self._param_bytes: dict[tuple[str, int], float] = {}

    def param_read_bytes(self, comp_name: str, index: int, full: float) -> float:
        """HBM bytes a fused computation reads of its parameter `index` (of `full` bytes)."""
        key = (comp_name, index)
        if key not in self._param_bytes:
            self._param_bytes[key] = full  # cycle guard
            comp = self.comps.get(comp_name)
            param = comp.parameter(index) if comp else None
            self._param_bytes[key] = (
                full if param is None else self._read_bytes(comp, param.name, full)
            )
        return self._param_bytes[key]

    def _read_bytes(self, comp: Computation, name: str, full: float) -> float:
        users = comp.users.get(name, [])
        if not users:
            return 0.0
        total = 0.0
        for user in users:
            if user.opcode in _SLICING and user.operands and user.operands[0] == name:
                total += sum(a.bytes for a in user.result)
            elif user.opcode in _IN_PLACE and user.operands[0] == name:
                continue  # updated in place: not read
            elif user.opcode == "bitcast":
                total += self._read_bytes(comp, user.name, full)
            elif user.opcode == "fusion" and user.called("calls"):
                callee = user.called("calls")[0]
                for i, op in enumerate(user.operands):
                    if op == name:
                        total += self.param_read_bytes(callee, i, full)
            else:
                return full
        return min(total, full)

    def written_bytes(self, instr: Instruction, caller: Computation) -> float:
        """HBM bytes `instr` writes: its result, or the updates of in-place updates."""
        if instr.opcode == "fusion" and instr.called("calls"):
            comp = self.comps.get(instr.called("calls")[0])
            if comp is not None:
                roots = [comp.root]
                if comp.root.opcode == "tuple":
                    roots = [comp.by_name[o] for o in comp.root.operands if o in comp.by_name]
                results = instr.result
                if len(roots) == len(results):
                    total = 0.0
                    for root, out in zip(roots, results, strict=True):
                        update = _update_bytes(root, comp)
                        total += out.hbm_bytes if update is None or not out.hbm_bytes else update
                    return total
        update = _update_bytes(instr, caller)
        return sum(a.hbm_bytes for a in instr.result) if update is None else update

    def instruction_bytes(self, instr: Instruction, comp: Computation) -> float:
        if instr.opcode in _FREE or instr.opcode.endswith("-done"):
            return 0.0
        total = self.written_bytes(instr, comp)
        callee = instr.called("calls")[0] if instr.opcode == "fusion" else None
        for i, op in enumerate(instr.operands):
            source = comp.by_name.get(op)
            if source is None or (i == 0 and instr.opcode in _IN_PLACE):
                continue
            full = sum(a.hbm_bytes for a in source.result)
            total += self.param_read_bytes(callee, i, full) if callee and full else full
        return total


def analyze(text: str) -> HloCost:
    """FLOPs and HBM bytes of one call of the module printed in `text` (per device)."""
    comps = parse_module(text)
    walker = _Walker(comps)
    entry = next((c for c in comps.values() if c.is_entry), None)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    # Multiplicity of each computation (calls per program call); fused ones are flagged
    # so that their instructions count FLOPs but no memory traffic of their own.
    mult: dict[str, float] = {entry.name: 1.0}
    fused: set[str] = set()
    loops: list[tuple[str, int]] = []
    unknown = 0
    for comp in reversed(list(comps.values())):  # callers before callees
        m = mult.get(comp.name, 0.0)
        if not m:
            continue
        for instr in comp.instructions:
            edges: list[tuple[str, float]] = []
            if instr.opcode == "while":
                body, cond = instr.called("body"), instr.called("condition")
                n = None
                if cond and cond[0] in comps:
                    body_comp = comps.get(body[0]) if body else None
                    n = trip_count(comps[cond[0]], body_comp, instr, comp)
                if n is None:  # a condition of another form (XLA:CPU wraps the compare)
                    n = known_trip_count(instr)
                if n is None:
                    unknown += 1
                    n = 1
                loops.append((instr.name, n))
                edges = [(c, n) for c in body] + [(c, n + 1) for c in cond]
            elif instr.opcode == "fusion":
                edges = [(c, 1.0) for c in instr.called("calls")]
                fused.update(instr.called("calls"))
            elif instr.opcode in ("call", "async-start"):
                edges = [(c, 1.0) for c in instr.called("to_apply") + instr.called("calls")]
            elif instr.opcode == "conditional":
                edges = [(c, 1.0) for c in instr.called("branch_computations")]
            for callee, factor in edges:
                mult[callee] = mult.get(callee, 0.0) + m * factor
    flops = 0.0
    hbm = 0.0
    no_cost = estimated = 0
    for comp in comps.values():
        m = mult.get(comp.name, 0.0)
        if not m:
            continue
        for instr in comp.instructions:
            estimate = _cost_estimate(instr) if instr.opcode == "custom-call" else None
            if instr.opcode in ("dot", "convolution"):
                flops += m * _contraction_flops(instr, comp)
            elif instr.opcode == "custom-call" and "tpu_custom_call" in instr.attrs:
                if estimate is not None:
                    flops += m * estimate.get("flops", 0.0)
                elif (splash := _splash_flops(instr)) is not None:
                    flops += m * splash
                    estimated += int(m)
                else:
                    no_cost += int(m)
            elif instr.opcode == "custom-call" and (gemm := _cublas_flops(instr, comp)):
                flops += m * gemm
            if comp.name in fused:
                continue
            if estimate is not None and "bytes_accessed" in estimate:
                hbm += m * estimate["bytes_accessed"]
            else:
                hbm += m * walker.instruction_bytes(instr, comp)
    return HloCost(flops, hbm, loops, unknown, no_cost, estimated)
