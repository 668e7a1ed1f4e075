"""The paper's experiments (SPEC §8), one module each. So far: layer freezing."""

from extractive_lens.experiments.freezing import FreezingResult, layer_freezing

__all__ = ["FreezingResult", "layer_freezing"]
