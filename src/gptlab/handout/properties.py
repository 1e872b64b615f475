"""The handout's properties as functions, and `Check`, the one result type of `gptlab lab`, `verify`, `check`.

The lab (lab.py) runs them on small models it builds itself, `verify` (inspection/) on trained ones,
`check` (gptlab.handout.learner) on a learner's own code, where a failure also carries its likely `cause`:
rows sum to one (§3.2), fused = separate projections and heads (§4.2), a tied head is the embedding
tensor (§6), permutation equivariance without positions (§6.1), and outputs at i ignoring every
later input, exactly (§7.3). Comparisons state their tolerance and report the largest difference:
absolute in the lab, `relative` in verify (EPSILONS float epsilons of the model's dtype, times the
values' size). `gptlab.model` is reached through its name (`M.attention`) so that a test which
monkeypatches it breaks these references too. Nothing here imports generation or inspection code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from gptlab import model as M

UNBELIEVED = ("the checking process reported a pass without the numbers behind it: the learner's code "
              "changed the checks while they ran")
TAMPERED = ("the numbers measured fail this check although the checking process reported a pass: the "
            "learner's code changed torch or the checks while they ran")
EPSILONS = 100  # verify's tolerances: this many machine epsilons of the model's dtype, times the values' size

Reference = torch.Tensor | Sequence
Tolerance = float | Callable[[torch.Tensor], float]  # a bound, or one computed from the reference


@dataclass(frozen=True)
class Evidence:
    """The raw numbers a verdict is computed from, so that another process can compute it again (`judge`):
    `gptlab check` takes only numbers from the process that runs a learner's code, never verdicts."""

    rule: str  # a key of RULES
    values: tuple[torch.Tensor, ...]
    bound: float = 0.0

    def record(self) -> dict[str, Any]:
        """As JSON-ready data: each tensor as its shape and its values in float64."""
        return {"rule": self.rule, "bound": self.bound,
                "values": [{"shape": list(t.shape), "data": t.detach().double().flatten().tolist()}
                           for t in self.values]}

    @staticmethod
    def from_record(record: dict[str, Any]) -> Evidence:
        """The evidence `record()` wrote."""
        values = tuple(torch.tensor(value["data"], dtype=torch.float64).reshape(value["shape"])
                       for value in record["values"])
        return Evidence(str(record["rule"]), values, float(record["bound"]))


@dataclass(frozen=True)
class Check:
    """One verified statement: the lab prints expected beside computed, verify deviation beside tolerance."""

    section: str  # e.g. "§2.1", or "pad" for properties the handout does not number
    name: str  # short description, e.g. "retrieval output y"
    passed: bool | None  # None where the property does not apply to the model
    expected: str = ""  # the expectation in words, with its tolerance
    computed: str = ""  # the computed value in words
    deviation: float | None = None  # the measured number: max |difference|, or the quantity bounded
    tolerance: float | None = None  # the bound it is held to
    note: str = ""  # what was measured, or why the property does not apply
    cause: str = ""  # on a failure of a learner's code: the most likely cause and its fix
    evidence: Evidence | None = field(default=None, compare=False, repr=False)  # what `passed` comes from

    @property
    def verdict(self) -> str:
        """PASS, FAIL, or n/a where the property does not apply, as both commands print it."""
        return {True: "PASS", False: "FAIL", None: "n/a"}[self.passed]

    def record(self) -> dict[str, Any]:
        """The fields as plain data, without the evidence."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "evidence"}


def failed(checks: Iterable[Check]) -> list[Check]:
    """The checks that apply to the model and do not hold."""
    return [c for c in checks if c.passed is False]


def skipped(section: str, name: str, why: str) -> Check:
    """A check that cannot apply here, with the reason (never reported as passed)."""
    return Check(section, name, None, note=why)


def explain(check: Check, cause: str, nan: str = "") -> Check:
    """`check` with its most likely cause attached if it failed (a passing or skipped one is unchanged);
    `nan`, if given, instead when the numbers behind the failure hold a NaN (which then explains it)."""
    if check.passed is not False or check.cause:
        return check
    has_nan = check.evidence is not None and any(bool(t.isnan().any()) for t in check.evidence.values)
    return replace(check, cause=nan if nan and has_nan else cause)


# ---------------------------------------------------------------------------------------------
# Comparisons: every one states its tolerance and reports the largest difference.


def fmt(values: torch.Tensor | list | tuple | float) -> str:
    """Nested lists with six decimals; tensors too big to read are summarised by their shape."""
    if isinstance(values, torch.Tensor):
        if values.numel() > 16:
            return f"<tensor of shape {tuple(values.shape)}>"
        values = values.detach().double().tolist()
    if isinstance(values, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in values) + "]"
    return f"{round(float(values), 6) + 0.0:.6f}"  # + 0.0 turns -0.0 into 0.0


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64; infinite when the shapes differ, so that a mismatch never passes."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item()


def relative(eps: float) -> Callable[[torch.Tensor], float]:
    """verify's tolerance: EPSILONS * eps times the reference's size (max |value|, at least 1)."""
    return lambda reference: EPSILONS * eps * max(1.0, float(reference.abs().max()))


def all_close(section: str, name: str, pairs: Iterable[tuple[torch.Tensor, Reference]], tol: Tolerance,
              shown: str | None = None, note: str = "") -> Check:
    """Each computed tensor matches its reference elementwise within tol (a NaN or a shape mismatch fails)."""
    tensors = [(got, ref if isinstance(ref, torch.Tensor) else torch.tensor(ref, dtype=torch.float64))
               for got, ref in pairs]
    deviation = max(max_diff(got, ref) for got, ref in tensors)
    bound = max(tol(ref) if callable(tol) else tol for _, ref in tensors)
    got, ref = tensors[0] if len(tensors) == 1 else ([p[0] for p in tensors], [p[1] for p in tensors])
    return Check(section, name, deviation <= bound, f"{shown or fmt(ref)} (max |diff| <= {bound:g})",
                 f"{fmt(got)} (max |diff| = {deviation:.1e})", deviation, bound, note,
                 evidence=Evidence("close", tuple(t.detach() for pair in tensors for t in pair), bound))


def close(section: str, name: str, computed: torch.Tensor, reference: Reference, tol: Tolerance,
          shown: str | None = None, note: str = "") -> Check:
    """computed matches reference elementwise within tol; `shown` describes the reference in words."""
    return all_close(section, name, [(computed, reference)], tol, shown, note)


def identical(section: str, name: str, computed: torch.Tensor, reference: torch.Tensor, what: str) -> Check:
    """computed is bit-identical to reference (torch.equal)."""
    same, diff = torch.equal(computed, reference), max_diff(computed, reference)
    return Check(section, name, same, f"{what}: bit-identical (torch.equal)",
                 f"torch.equal = {same}, max |diff| = {diff:.1e}", diff, 0.0,
                 evidence=Evidence("equal", (computed.detach(), reference.detach())))


def exceeds(section: str, name: str, value: float, bound: float, what: str, note: str = "") -> Check:
    """A property that must visibly hold: value > bound (e.g. outputs do move)."""
    return Check(section, name, value > bound, f"{what} > {bound:g}", f"{value:.3e}", value, bound, note,
                 evidence=Evidence("above", (torch.tensor(float(value)),), bound))


def at_most(section: str, name: str, value: float, bound: float, expected: str, computed: str,
            note: str = "", cause: str = "") -> Check:
    """A measured number held to a bound: value <= bound, with the expectation and the value in words."""
    return Check(section, name, value <= bound, expected, computed, value, bound, note, cause,
                 evidence=Evidence("within", (torch.tensor(float(value)),), bound))


def differs(section: str, name: str, a: torch.Tensor, b: torch.Tensor, bound: float) -> Check:
    """a and b differ somewhere by more than bound."""
    return exceeds(section, name, max_diff(a, b), bound, "max |diff|")


# ---------------------------------------------------------------------------------------------
# Properties


def rows_sum_to_one(weights: Sequence[torch.Tensor], tol: float, name: str = "attention rows sum to one",
                    note: str = "") -> Check:
    """§3.2: every row of the given attention weights (..., Tq, Tk) sums to one over the keys."""
    sums = [w.sum(-1) for w in weights]
    shown = sums[0] if len(sums) == 1 else torch.cat([s.flatten() for s in sums])
    return close("§3.2", name, shown, torch.ones_like(shown), tol, "1 for every row", note)


def fused_and_separate(attn: M.CausalSelfAttention,
                       x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """§4.2 on input rows x (B, T, D): (fused, separate) for Q, K and V, then (module, heads written out)."""
    B, T, D = x.shape
    H, group = attn.n_head, attn.n_head // attn.n_kv_head  # query heads per key/value head
    biases = attn.c_attn.bias.split(attn.widths) if attn.c_attn.bias is not None else (None,) * 3
    separate = [F.linear(x, weight, bias).view(B, T, -1, D // H).transpose(1, 2)  # (B, H or Hkv, T, hs)
                for weight, bias in zip(attn.c_attn.weight.split(attn.widths), biases, strict=True)]
    norms = (attn.q_norm, attn.k_norm)  # qk_norm's RMSNorms (identities when off), before RoPE as in model.py
    separate[:2] = [attn.rotate(norm(t)) for norm, t in zip(norms, separate[:2], strict=True)]  # not values
    mask = M.causal_mask(T, T, x.device) if attn.causal else None
    q, k, v = separate
    heads = [M.attention(q[:, h], k[:, h // group], v[:, h // group], mask)[0]  # H x (B, T, hs)
             for h in range(H)]
    return [*zip(attn.project(x), separate, strict=True), (attn(x), attn.c_proj(torch.cat(heads, dim=-1)))]


def tied_head(tied: bool, head: torch.Tensor, embedding: torch.Tensor) -> Check:
    """§6: a tied vocabulary head is the token embedding tensor itself (same object, same memory)."""
    name = "tied head is the embedding tensor"
    if not tied:
        return Check("§6", name, None, note="untied model: its head is a matrix of its own")
    shared, same_memory = head is embedding, head.data_ptr() == embedding.data_ptr()
    deviation = float((head - embedding).detach().abs().max())  # model dtype: no float64 copy of (V, D)
    return Check("§6", name, shared and same_memory, "same object and same data_ptr",
                 f"is = {shared}, same data_ptr = {same_memory}", deviation, 0.0,
                 f"same object and storage: {shared and same_memory}")


def permutation_equivariant(name: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                            perm: torch.Tensor, tol: Tolerance, shown: str | None = None,
                            note: str = "") -> Check:
    """§6.1: permuting the rows (dim 1) of x permutes the rows of fn(x), within tol."""
    return close("§6.1", name, fn(x[:, perm]), fn(x)[:, perm], tol, shown, note)


def ignores_later_inputs(dependence: torch.Tensor | Evidence, name: str, what: str = "change",
                         note: str = "") -> Check:
    """§7.3: entry (i, j) of `dependence` (T, T) says how much output i moves with input j: 0 for j > i.

    Given as the matrix, or as the raw outputs it is reduced from (`changes`, `gradient_rows`)."""
    evidence = (dependence if isinstance(dependence, Evidence)
                else Evidence("dependence", (dependence.detach(),)))
    future = float(dependence_matrix(evidence).triu(1).max())
    return Check("§7.3", name, future == 0.0, f"{what} exactly 0 for every j > i",
                 f"max |{what}| over j > i = {future:.1e}", future, 0.0, note, evidence=evidence)


def changes(clean: torch.Tensor, changed: torch.Tensor) -> Evidence:
    """§7.3 evidence from outputs (B, T, ...) and (T - 1, B, T, ...), where changed[j - 1] is the output
    with every input from position j on redrawn."""
    return Evidence("changes", (clean.detach(), changed.detach()))


def gradient_rows(rows: torch.Tensor) -> Evidence:
    """§7.3 evidence from gradients (..., T, T, D): d output i / d input row j (leading dims: e.g. blocks)."""
    return Evidence("gradients", (rows.detach(),))


def replacement_dependence(logits_of: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor,
                           generator: torch.Generator, first: int, vocab: int) -> Evidence:
    """`changes` of the logits when every token from j on is replaced, for j = 1 .. T - 1: their (T, T)
    dependence has entry (i, j) = max |change| of the logits at i. tokens is (1, T).

    Each replacement is another id in [first, vocab), drawn from `generator`.
    """
    clean = logits_of(tokens)  # (1, T, V)
    T = tokens.size(1)
    outputs = []
    for cut in range(T - 1):
        changed = tokens.clone()
        shift = torch.randint(1, max(2, vocab - first), (T - cut - 1,), generator=generator).to(tokens.device)
        changed[0, cut + 1:] = first + (tokens[0, cut + 1:] - first + shift) % (vocab - first)
        outputs.append(logits_of(changed))  # (1, T, V)
    return changes(clean, torch.stack(outputs) if outputs else clean.new_zeros(0, *clean.shape))


def _from_changes(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """(T, T) from `changes`: column j is max |changed[j - 1] - clean| over all but the position axis."""
    clean, changed = values
    T = clean.size(1)
    if T < 2:
        return torch.zeros(T, T, dtype=torch.float64)
    moved = (changed.double() - clean.double()).abs().transpose(1, 2)  # (T - 1, T, B, ...)
    return torch.cat([torch.zeros(T, 1, dtype=torch.float64), moved.reshape(T - 1, T, -1).amax(-1).T], dim=1)


def _from_gradients(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """(T, T) from `gradient_rows`: max |gradient| over features, then over any leading dims."""
    dependence = values[0].double().abs().amax(-1)
    return dependence.reshape(-1, *dependence.shape[-2:]).amax(0)


# How each kind of evidence becomes the number or matrix its verdict reads.
RULES: dict[str, Callable[[Sequence[torch.Tensor]], torch.Tensor]] = {
    "dependence": lambda values: values[0].double(),
    "changes": _from_changes,
    "gradients": _from_gradients,
}


def dependence_matrix(evidence: Evidence) -> torch.Tensor:
    """The (T, T) matrix a §7.3 evidence reduces to: entry (i, j), how much output i moves with input j."""
    return RULES[evidence.rule](evidence.values)


def judge(check: Check) -> Check:
    """`check` with `passed` and `deviation` computed again, here, from its evidence alone.

    What `gptlab check`'s parent does with every check its child sends: a child whose torch or gptlab was
    changed by the learner's code can still send numbers, but not a verdict. A pass without evidence
    is not believed."""
    evidence = check.evidence
    if check.passed is None or evidence is None:
        return replace(check, passed=False, cause=UNBELIEVED) if check.passed else check
    values, bound = evidence.values, evidence.bound
    if evidence.rule == "close":
        pairs = zip(values[0::2], values[1::2], strict=True)
        deviation = max((max_diff(a, b) for a, b in pairs), default=0.0)
        passed = deviation <= bound
    elif evidence.rule == "equal":
        passed, deviation = torch.equal(values[0], values[1]), max_diff(values[0], values[1])
    elif evidence.rule in ("above", "within"):
        deviation = float(values[0])
        passed = deviation > bound if evidence.rule == "above" else deviation <= bound
    elif evidence.rule in RULES:
        deviation = float(dependence_matrix(evidence).triu(1).max())
        passed = deviation == 0.0
    else:
        return replace(check, passed=False, cause=UNBELIEVED)
    cause = check.cause if passed is check.passed else "" if passed else TAMPERED
    return replace(check, passed=passed, deviation=deviation, tolerance=bound, cause=cause)
