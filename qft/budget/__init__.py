"""Trainable-parameter budgets: exact LoRA counts from module shapes on the meta device (no weights), and integer
ranks that meet a budget by `shares`, `uniform` or `fitted` (ranks.solve); with budget.bits_records, the bits of
the frozen base per layer type (bits.propose_bits). A rank-r adapter on a d_in x d_out projection has
r * (d_in + d_out) parameters, so each group costs a fixed count per unit of rank. Submodules: costs, ranks,
fitted, bits, evidence (the records those read), cli (`python -m qft.budget`).

    python -m qft.budget model=smollm2_135m budget.params=1146000 budget.method=fitted \
        budget.records=results/rank_sweep/runs budget.records_data=bbc_news"""

from __future__ import annotations

from qft.budget.bits import BitsProposal, bits_records, propose_bits  # noqa: F401
from qft.budget.cli import main  # noqa: F401
from qft.budget.costs import allocations, cost_per_rank, groups, meta_layers, uniform  # noqa: F401
from qft.budget.evidence import one_dataset  # noqa: F401
from qft.budget.fitted import COEFFICIENTS, FORM, Fit, Proposal, features, fit, fit_records, propose  # noqa: F401
from qft.budget.ranks import METHODS, SPLITS, apply, check, solve, solve_shares  # noqa: F401
