"""Theory next to measurement: alpha and c on your models, predictions against the bench, replayed
speedups, roofline costs and lossless checks, over the closed forms in specdec.planning."""
