"""Draft heads that read the target's own hidden states: EAGLE, EAGLE-3, Medusa and the MLP speculator.

Each reuses the target's token embedding and output head (frozen) and adds a few trainable
weights, stored apart from the target as safetensors with their config in the file's metadata.
EAGLE (Li et al. 2024, arXiv 2401.15077) drafts at the feature level with one decoder layer;
EAGLE-3 (Li et al. 2025, arXiv 2503.01840) fuses low, middle and high layers' features and
predicts tokens directly, in the layout vLLM and the speculators library run, so a head trained
here exports to them (specdec export-head) and theirs load here; Medusa (Cai et al. 2024, arXiv
2401.10774) puts m residual heads on the last feature; the MLP speculator (Wertheimer et al. 2024,
arXiv 2404.19124) chains small MLP stages on it and the drafted tokens. Each module's docstring has
the equations.

One job a module: config.py (HeadConfig), layers.py (the frozen vocabulary and the layer parts
the heads share), eagle.py, eagle3.py, medusa.py and mlp_speculator.py (the heads), checkpoint.py (safetensors
checkpoints, build_head), speculators.py (the layout vLLM and SGLang load) and loading.py (a
head for a loaded target). The modules import one another, never this package's __init__, so
importing any of them forms no circle (tests/test_imports.py).
"""

from __future__ import annotations

from specdec.models.heads.checkpoint import LoadedHead, build_head, load_head, quantize_head, save_head
from specdec.models.heads.config import HEAD_KINDS, HeadConfig
from specdec.models.heads.eagle import EagleHead
from specdec.models.heads.eagle3 import Eagle3Head
from specdec.models.heads.layers import FrozenVocabulary, HeadKVCache, attend, project_qkv, rotary_angles
from specdec.models.heads.loading import default_head_path, frozen_vocabulary, load_head_for, locate_head
from specdec.models.heads.medusa import MedusaHeads
from specdec.models.heads.mlp_speculator import MLPSpeculator

__all__ = ["HEAD_KINDS", "Eagle3Head", "EagleHead", "FrozenVocabulary", "HeadConfig", "HeadKVCache", "LoadedHead",
           "MLPSpeculator", "MedusaHeads", "attend", "build_head", "default_head_path", "frozen_vocabulary", "load_head",
           "load_head_for", "locate_head", "project_qkv", "quantize_head", "rotary_angles", "save_head"]
