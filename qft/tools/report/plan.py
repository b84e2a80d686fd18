"""A study's declared analysis as written (plan.yaml), checked before any record is read: a bad plan is one line
naming the key, the value and what is allowed (the report exits 2), never a report on a misread plan."""

from __future__ import annotations

import numbers
from pathlib import Path

from qft.tools.report.compare import MARGIN

RELATIVE = {"relative_to", "factor"}  # margin: {relative_to: CONTROL, factor: F}: F x the control's measured cost


def read_plan(path: Path) -> dict:
    """The declared analysis in plan.yaml `path`: metric, margin (a number, or relative to a control's cost), alpha,
    contrasts (cell a - cell b) and optional positive `controls`; `contrasts_amended` and `seeds_amended` replace
    the declared lists. Raises ValueError, one line naming the key, on a bad plan."""
    import yaml

    try:
        plan = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--plan={path}: not a readable YAML file ({type(e).__name__})") from e
    if not isinstance(plan, dict):
        raise ValueError(f"--plan={path}: a YAML map of metric, margin, alpha, contrasts, ...")
    for key, need in (("contrasts", True), ("contrasts_amended", False), ("controls", False)):
        if key not in plan and not need:
            continue
        items = plan.get(key)
        if not isinstance(items, list) or not items or not all(
                isinstance(c, dict) and {"name", "a", "b"} <= set(c) for c in items):
            raise ValueError(f"--plan={path}: {key} must be a list of {{name, a, b}} with a and b as column: value maps")
    if plan.get("metric", "accuracy") not in ("accuracy", "loglik"):
        raise ValueError(f"--plan={path}: metric must be accuracy or loglik")
    for key in ("seeds", "seeds_amended"):
        seeds = plan.get(key)
        if seeds is not None and (not isinstance(seeds, list) or not seeds or not all(
                isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
            raise ValueError(f"--plan={path}: {key} must be a non-empty list of integer seeds")
    names = [c["name"] for c in plan.get("controls") or []]
    clash = sorted({n for n in names if names.count(n) > 1} | set(names) & {c["name"] for c in plan["contrasts"]})
    if clash:
        raise ValueError(f"--plan={path}: controls={clash}: each control needs a name no other control or contrast has")
    _check_margin(path, plan.get("margin", MARGIN), names)
    return {"metric": "accuracy", "margin": MARGIN, "alpha": 0.05, **plan,
            "contrasts": plan.get("contrasts_amended", plan["contrasts"])}


def _number(x) -> bool:
    """Whether `x` is a real number (not a bool, not NaN)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == x


def _check_margin(path, margin, controls: list) -> None:
    """Raise ValueError naming plan `path` unless `margin` is a number > 0 or {relative_to: one of `controls`,
    factor: F in (0, 1]}."""
    if isinstance(margin, dict):
        if set(margin) != RELATIVE:
            raise ValueError(f"--plan={path}: margin={margin}: a number > 0, or {{relative_to: CONTROL, factor: F}} "
                             "(no other keys)")
        if margin["relative_to"] not in controls:
            raise ValueError(f"--plan={path}: margin.relative_to={margin['relative_to']!r}: not a declared control; "
                             f"allowed: {', '.join(map(repr, controls)) or 'none (the plan declares no controls)'}")
        if not (_number(margin["factor"]) and 0 < margin["factor"] <= 1):
            raise ValueError(f"--plan={path}: margin.factor={margin['factor']!r}: a number > 0 and <= 1 (the share of "
                             "the control's measured cost)")
    elif not (_number(margin) and margin > 0):
        raise ValueError(f"--plan={path}: margin={margin!r}: a number > 0, or {{relative_to: CONTROL, factor: F}}")


def declared_seeds(plan: dict) -> list | None:
    """The seeds `plan`'s verdicts use (the amended list where there is one), or None: a contrast is analysed on
    exactly these, so a report run mid-study gives no early verdict."""
    seeds = plan.get("seeds_amended", plan.get("seeds"))
    return None if seeds is None else sorted(set(seeds))
