"""How much to draft: Leviathan et al.'s closed forms (theory.py) and measured step costs (costs.py).

The runtime chooses k (engine/adaptive.py) and tree sizes (proposers/tree_budget.py) from these,
and the research tools (analysis/: measure, predicted, replay) report against the same formulas,
so this package sits below both: it imports nothing of specdec's.
"""
