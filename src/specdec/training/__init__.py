"""Training draft heads (EAGLE, Medusa) on a frozen target."""
