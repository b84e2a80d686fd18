"""Trainable-parameter budgets: exact LoRA counts from module shapes alone, and ranks that meet a budget.

The model is built on the meta device, so a 70B architecture is planned in seconds from its config with no
weights on the machine. A LoRA adapter of rank r on a d_in x d_out projection has r * (d_in + d_out)
parameters, so each layer type (or depth group) has a fixed cost per unit of rank, and a budget is solved
for integer ranks by one of three methods: `shares` (the split between groups nearest the requested shares),
`uniform` (the same rank on every group) or `fitted` (per layer type, the allocation a model of accuracy
against rank, least-squares fitted on a study's result records, predicts best; see `fit` and `propose`).
With `budget.bits_records` (a bits sweep's records) it also proposes the bits of the frozen base per layer type:
the smallest base the seed noise cannot tell from the best (`propose_bits`).

    python -m qft.budget model=smollm2_135m budget.params=1000000
    python -m qft.budget model=local model.path=/models/Llama-2-7b budget.params=4e6 budget.split=depth
    python -m qft.budget model=smollm2_135m budget.params=1146000 budget.method=fitted \
        budget.records=results/rank_sweep/runs budget.records_data=bbc_news
    python -m qft.budget budget.params=1831680 budget.method=fitted budget.records=results/rank_sweep/runs \
        budget.records_data=reuters_r8 budget.bits_records=results/bits_sweep/runs

One module a concern: costs (cost per unit of rank, the uniform rank, grid allocations), ranks (check, solve, apply),
fitted (Fit, fit, propose), bits (propose_bits), evidence (the records those read), cli (`python -m qft.budget`).
"""

from __future__ import annotations

from qft.budget.bits import BitsProposal, bits_records, propose_bits  # noqa: F401
from qft.budget.cli import main  # noqa: F401
from qft.budget.costs import allocations, cost_per_rank, groups, meta_layers, uniform  # noqa: F401
from qft.budget.evidence import one_dataset  # noqa: F401
from qft.budget.fitted import COEFFICIENTS, FORM, Fit, Proposal, features, fit, fit_records, propose  # noqa: F401
from qft.budget.ranks import METHODS, SPLITS, apply, check, solve, solve_shares  # noqa: F401
